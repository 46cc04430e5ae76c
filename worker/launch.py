"""How a worker starts a job's trainer: one process for a one-GPU job, N ranks through
`torch.distributed.run` for an N-GPU job (trainers/core/distributed.py explains what the ranks do).

`torch.distributed.run --standalone` sets up the rendezvous on a free local port and each rank's
`RANK`, `LOCAL_RANK` and `WORLD_SIZE`; `--max-restarts 0` because restarts are the job's business
(worker/recovery.py resumes it from its latest checkpoint): when any rank dies the launcher stops the
others and exits non-zero, and the supervisor requeues the job.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import platform
import signal
import subprocess
import sys
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

from service.config import Settings
from service.jobs.capacity import DeviceInfo
from service.jobs.resources import queues_served

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


@lru_cache
def _detected_gpus() -> int:
    """GPUs this host gives its worker, without importing torch: `CUDA_VISIBLE_DEVICES` when set, else
    the NVIDIA driver's device list; 1 on a host with none (a CPU job)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    else:
        count = len(list(NVIDIA_GPUS.iterdir())) if NVIDIA_GPUS.is_dir() else 0
    return max(1, count)


def worker_gpus(settings: Settings) -> int:
    return settings.worker_gpus or _detected_gpus()


@lru_cache
def worker_device() -> DeviceInfo:
    """What one of this host's devices is, without importing torch: the first visible GPU's name and
    memory from `nvidia-smi`, or on a host without one, the CPU and the machine's RAM (a CPU job's
    memory)."""
    if _detected_gpus_present():
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
            name, mib = out.splitlines()[0].rsplit(",", 1)
            return DeviceInfo("cuda", name.strip(), int(float(mib)) * 2**20)
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return DeviceInfo("cuda", None, None)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceInfo("cpu", platform.processor() or platform.machine() or None, int(ram))


def _detected_gpus_present() -> bool:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return any(d.strip() and d.strip() != "-1" for d in visible.split(","))
    return NVIDIA_GPUS.is_dir() and any(NVIDIA_GPUS.iterdir())


def worker_queues(settings: Settings) -> list[str]:
    """The queues this training worker consumes and claims from: jobs of 1..its GPUs, and multi-node
    jobs when it is pointed at a Ray cluster (it drives them: worker/ray_driver.py)."""
    return queues_served(settings.job_queue, worker_gpus(settings), ray=bool(settings.ray_address))


TRAINER_MODULE = "worker.job_process"  # a trainer process's entry point
HOST_FLAG = "--shared-base"  # its flag to train several jobs on one base (worker/shared_base_host.py)

# peft imports bitsandbytes whenever it is installed, and bitsandbytes imports torch's inductor: ~1 s of
# CPU at every trainer's start (`import peft` ~4.4 s with it, ~3.4 s without, on a quiet 2-core host).
# Only a quantized (QLoRA) job's trainer uses it, so every other trainer, and the spare, starts with
# this variable set and leaves it out (`leave_out_bitsandbytes_if_asked`). Off by default: a process
# started some other way (a Ray rank, a test) imports what peft imports.
WITHOUT_BITSANDBYTES = "TUNEHOUSE_TRAINER_WITHOUT_BITSANDBYTES"


def leave_out_bitsandbytes_if_asked() -> None:
    """If this trainer was started with ``WITHOUT_BITSANDBYTES``, make bitsandbytes look not installed to
    peft and transformers (``importlib.util.find_spec`` answers None for a module set to None, and its
    import fails). Called before anything imports peft (worker/job_process.py's first lines)."""
    if os.environ.get(WITHOUT_BITSANDBYTES) == "1":
        sys.modules.setdefault("bitsandbytes", None)  # type: ignore[arg-type]


def trainer_command(job_id: str, worker_id: str, *, ranks: int, grace_seconds: float) -> list[str]:
    """The trainer process of a job: itself for one rank, else the launcher of its `ranks` processes.

    On SIGTERM (a worker shutting down) the launcher passes SIGTERM to every rank and waits
    `grace_seconds` before it kills them: the same time a one-rank trainer gets to checkpoint."""
    entry = ["-m", TRAINER_MODULE, job_id, worker_id]
    if ranks == 1:
        return [sys.executable, *entry]
    launcher = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "--max-restarts=0",  # restarts are the job's, from its latest checkpoint
        f"--shutdown-timeout={math.ceil(grace_seconds)}",
    ]
    return [sys.executable, *launcher, *entry]


def shared_base_command(worker_id: str, notices: str) -> list[str]:
    """A trainer of several LoRA jobs on one base (worker/shared_base_host.py), writing to `notices`."""
    return [sys.executable, "-m", TRAINER_MODULE, HOST_FLAG, worker_id, notices]


DRIVER_MODULE = "worker.ray_driver"  # a multi-node job's driver: it runs the ranks on Ray


def driver_command(job_id: str, worker_id: str) -> list[str]:
    """The process that drives a multi-node job's ranks on the Ray cluster (worker/ray_driver.py); the
    supervisor heartbeats while it lives, as for a trainer."""
    return [sys.executable, "-m", DRIVER_MODULE, job_id, worker_id]


# A training step allocates and frees the same large tensors (activations, gradients, a chunk of logits)
# over and over. By default glibc serves every block over its mmap threshold with a fresh mmap and unmaps
# it on free, so each step pays the kernel's page faults and zeroing for those pages again (one exp of a
# SmolLM2 logits chunk: ~11x slower allocating than in place). With mmap off and trimming off, freed
# blocks stay in the heap and the next step reuses them: SmolLM2 SFT LoRA on the CPU trains ~1.15x faster
# at the same peak RSS (git log -p docs/benchmarks.md, "The trainer's allocator"). A trainer is one
# process per job, so memory it keeps is returned when the job ends.
# The per-thread cache (tcache) and the fast bins are off too: a small block freed into either still counts
# as in use, so the freed activations on both sides of it cannot merge, and the next micro-batch's
# slightly wider tensors then come from fresh memory at the heap's top. With them on, a SmolLM2 reward
# model's heap grew by another working set on its second micro-batch although 2 GiB of it were free;
# with them off, peak RSS fell 24-30% and the steps ran 11-16% faster (fewer fresh pages to fault in).
TRAINER_MALLOC_TUNABLES = (
    "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"
    ":glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0"
)


def trainer_environment(base: Mapping[str, str], *, quantized: bool = False) -> dict[str, str]:
    """The environment of a trainer process: `base` with glibc's allocator told to keep freed memory,
    unless the operator set `GLIBC_TUNABLES` themselves (theirs wins). Other C libraries ignore it.
    Without bitsandbytes (``WITHOUT_BITSANDBYTES``) unless the job is `quantized`.

    The variable goes last: glibc moves its string out of the block that holds the command line and
    the environment, and setproctitle (a spare trainer names itself after its job: spare_trainer.py)
    rewrites that block only up to the first string out of place."""
    env = {k: v for k, v in base.items() if k not in ("GLIBC_TUNABLES", WITHOUT_BITSANDBYTES)}
    if not quantized:
        env[WITHOUT_BITSANDBYTES] = "1"
    env["GLIBC_TUNABLES"] = base.get("GLIBC_TUNABLES", TRAINER_MALLOC_TUNABLES)
    return env


def start_trainer(
    command: list[str], *, stdin: int | None = None, quantized: bool = False, pass_fds: tuple[int, ...] = ()
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        command,
        env=trainer_environment(os.environ, quantized=quantized),
        stdin=stdin,
        pass_fds=pass_fds,
        preexec_fn=die_with_parent,
    )


def trainer_exited(proc: subprocess.Popen[bytes], *, within: float) -> bool:
    """Whether the trainer has exited, waiting up to `within` seconds for it. It returns within ~50 ms
    of the exit (`Popen.wait` polls at most that far apart), so the worker takes its next job then: a
    plain sleep of `within` between polls held a queued job back by up to that long."""
    try:
        proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        return False
    return True


def kill_trainer(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the trainer and every process it started (a multi-GPU job's ranks), and reap it.

    The ranks would get only SIGTERM from their launcher's death (`die_with_parent`), which asks them to
    checkpoint: a trainer killed for overrunning its grace or losing its lease must stop at once. They
    are found by parent pid rather than by process group, so that stopping a worker's group (a terminal's
    Ctrl-C, an init system) still reaches its trainer as before."""
    doomed = [proc.pid, *_descendants(proc.pid)]
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _descendants(pid: int) -> list[int]:
    """The pids of `pid`'s children, their children, ... (Linux /proc; none elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent dies, so no orphan keeps the GPU; SIGTERM makes
    a trainer checkpoint and hand the job back itself (worker/job_process.py). Set in the trainer's
    child (the supervisor's `preexec_fn`, no window for the parent to die first) and again by each rank
    of a multi-GPU job, whose parent is the launcher."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
