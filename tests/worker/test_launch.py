"""How a worker sizes itself and starts a job's trainer (worker/launch.py, service/jobs/resources.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service.config import Settings
from service.jobs.resources import Resources, global_batch_size, queue_for, queues_served
from worker import launch


@pytest.mark.parametrize(("visible", "expected"), [("0,1,2", 3), ("3", 1), ("", 1), ("-1", 1), ("0, 1", 2)])
def test_gpus_follow_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch, visible: str, expected: int
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    launch._detected_gpus.cache_clear()
    try:
        assert launch.worker_gpus(Settings(worker_gpus=None)) == expected
        assert launch.worker_gpus(Settings(worker_gpus=5)) == 5  # the operator's word wins
    finally:
        launch._detected_gpus.cache_clear()


def test_a_worker_consumes_every_job_size_it_holds() -> None:
    assert queues_served("pool", 1) == ["pool"]
    assert queues_served("pool", 3) == ["pool", "pool.gpus2", "pool.gpus3"]
    assert queue_for("pool", Resources()) == "pool" and queue_for("pool", Resources(gpus=4)) == "pool.gpus4"
    assert queue_for("pool", Resources(nodes=2, gpus_per_node=4)) == "pool.ray"
    assert queues_served("pool", 2, ray=True) == ["pool", "pool.gpus2", "pool.ray"]
    settings = Settings(job_queue="pool", worker_gpus=2)
    assert launch.worker_queues(settings) == ["pool", "pool.gpus2"]


def test_one_rank_is_a_plain_process_and_more_go_through_torch_distributed_run() -> None:
    assert launch.trainer_command("ftjob-1", "w", ranks=1, grace_seconds=60) == [
        sys.executable,
        "-m",
        "worker.job_process",
        "ftjob-1",
        "w",
    ]
    cmd = launch.trainer_command("ftjob-1", "w", ranks=4, grace_seconds=59.5)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=4" in cmd and "--standalone" in cmd
    assert "--max-restarts=0" in cmd  # restarts are the job's (from its checkpoint), not the launcher's
    # the launcher's wait between SIGTERM and SIGKILL to its ranks: the worker's shutdown grace
    assert "--shutdown-timeout=60" in cmd
    assert cmd[-4:] == ["-m", "worker.job_process", "ftjob-1", "w"]


def test_global_batch_is_batch_times_accumulation_times_gpus() -> None:
    assert global_batch_size({"batch_size": 4, "gradient_accumulation_steps": 3}, 2) == 24
    assert global_batch_size({"batch_size": 4}, 8) == 32
    assert global_batch_size({"batch_size": "auto"}, 2) is None


def test_killing_a_trainer_kills_the_ranks_it_started(tmp_path: Path) -> None:
    """A launcher that ignores SIGTERM (as torch.distributed.run does while its ranks checkpoint), with a
    child that would outlive it: `kill_trainer` leaves neither behind."""
    child_pid = tmp_path / "child.pid"
    script = (
        "import signal, subprocess, sys, time, pathlib\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"pathlib.Path({str(child_pid)!r}).write_text(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    proc = launch.start_trainer([sys.executable, "-c", script])
    deadline = time.monotonic() + 30
    while not child_pid.exists() or not child_pid.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    rank = int(child_pid.read_text())
    launch.kill_trainer(proc)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while _alive(rank):
        assert time.monotonic() < deadline, "the launcher's child outlived it"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, dead but not yet reaped by init, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


_FREE_A_LARGE_BLOCK = (
    "import pathlib, sys\n"
    "def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
    "block = bytearray(b'\\x01') * (256 << 20)\n"  # written, so its pages are resident
    "held = rss()\n"
    "del block\n"
    "pathlib.Path(sys.argv[1]).write_text(str(held - rss()))\n"
)


def test_a_trainer_keeps_freed_memory_for_its_next_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer's allocator keeps a freed 256 MiB block for reuse (no page faults for it next step); the
    same script started with the worker's own environment gives it back to the kernel at once."""
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)  # a setting of the caller's would win on both sides
    released = {}
    for name, start in (
        ("trainer", launch.start_trainer),
        ("plain", lambda command: subprocess.Popen(command, env=dict(os.environ))),
    ):
        out = tmp_path / name
        assert start([sys.executable, "-c", _FREE_A_LARGE_BLOCK, str(out)]).wait(timeout=60) == 0
        released[name] = int(out.read_text()) >> 20
    assert released["plain"] > 200, released  # the control: glibc's default unmaps it
    assert released["trainer"] < 16, released


# A step's pattern in glibc's terms: large blocks (activations) with small ones (bookkeeping) between them,
# all freed, then larger blocks (the next micro-batch's slightly wider tensors). Prints how many MiB the
# heap grew for them although 64 MiB were free.
_REUSE_FREED_BLOCKS = (
    "import ctypes, sys\n"
    "libc = ctypes.CDLL('libc.so.6')\n"
    "libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]\n"
    "libc.free.argtypes = [ctypes.c_void_p]\n"
    "class Info(ctypes.Structure):\n"
    "    _fields_ = [(n, ctypes.c_size_t) for n in 'arena ord smb hb hbh usm fsm uord ford keep'.split()]\n"
    "libc.mallinfo2.restype = Info\n"
    "small, big = 200, 8 << 20\n"
    "drained = [libc.malloc(small) for _ in range(10000)]\n"  # later small blocks come from the top
    "bigs, smalls = [], []\n"
    "for _ in range(8):\n"
    "    bigs.append(libc.malloc(big)); smalls.append(libc.malloc(small))\n"
    "guard = libc.malloc(small)\n"
    "for p in smalls + bigs: libc.free(p)\n"
    "before = libc.mallinfo2().arena\n"
    "wider = [libc.malloc(2 * big) for _ in range(3)]\n"
    "open(sys.argv[1], 'w').write(str((libc.mallinfo2().arena - before) >> 20))\n"
)


def test_a_trainer_merges_freed_blocks_across_small_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer's allocator serves larger blocks from freed ones that had small blocks between them; with
    glibc's per-thread cache on (the control: the trainer's setting before), the freed small blocks stay
    cached, the large ones cannot merge across them, and the heap grows by all 48 MiB asked for."""
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    keeping_only = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"
    grown = {}
    for name, start in (
        ("trainer", launch.start_trainer),
        (
            "cached",
            lambda command: subprocess.Popen(command, env={**os.environ, "GLIBC_TUNABLES": keeping_only}),
        ),
    ):
        out = tmp_path / name
        assert start([sys.executable, "-c", _REUSE_FREED_BLOCKS, str(out)]).wait(timeout=60) == 0
        grown[name] = int(out.read_text())
    assert grown["cached"] >= 32, grown
    assert grown["trainer"] == 0, grown


def test_an_operators_allocator_setting_wins() -> None:
    env = launch.trainer_environment({"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env == {
        "PATH": "/bin",
        launch.WITHOUT_BITSANDBYTES: "1",
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2",
    }
    assert launch.trainer_environment({})["GLIBC_TUNABLES"] == launch.TRAINER_MALLOC_TUNABLES


def test_a_trainer_process_leaves_the_apis_libraries_unimported() -> None:
    """A job's trainer process starts with every job: the web framework, the async database driver and
    the async Redis client are the API's, and importing them cost each start ~200 ms
    (git log -p docs/benchmarks.md, the service overhead). Celery is the worker's: a trainer imports it only
    when it sends a message (a hand-back), ~25 ms otherwise."""
    modules = ("fastapi", "sqlalchemy.ext.asyncio", "redis.asyncio", "celery")

    def imported_by(statement: str, **env: str) -> str:
        code = f"import sys; {statement}; print(sorted(m for m in {modules!r} if m in sys.modules))"
        return subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, **env},
        ).stdout

    # as the worker starts a trainer of an unquantized job: without bitsandbytes, which peft would import
    # (and with it torch's inductor, which imports redis and with it redis.asyncio)
    lean = launch.trainer_environment({})
    assert lean[launch.WITHOUT_BITSANDBYTES] == "1"
    assert imported_by("import worker.job_process", **lean) == "[]\n"


def test_only_a_quantized_jobs_trainer_imports_bitsandbytes() -> None:
    """peft imports bitsandbytes whenever it is installed (~1 s of each trainer's start); a trainer of an
    unquantized job leaves it out, a QLoRA job's keeps it (tests/e2e's QLoRA job trains through it)."""
    code = (
        "import sys, worker.job_process, peft.import_utils as u; "
        "print(u.is_bnb_available(), sys.modules.get('bitsandbytes') is not None)"
    )

    def run(env: dict[str, str]) -> str:
        clean = {k: v for k, v in os.environ.items() if k != launch.WITHOUT_BITSANDBYTES}
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**clean, **env}
        ).stdout.strip()

    assert run(launch.trainer_environment({})) == "False False"
    assert launch.WITHOUT_BITSANDBYTES not in launch.trainer_environment({}, quantized=True)
    assert run(launch.trainer_environment({}, quantized=True)) == "True True"


def test_a_worker_sees_its_trainer_exit_when_it_exits_not_at_the_end_of_its_wait() -> None:
    """`trainer_exited` returns as the process exits, so the worker's next job is not held back for
    the rest of the wait (a sleep between polls held it back up to 0.2 s per job)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    try:
        assert not launch.trainer_exited(proc, within=0.01)  # still running: False once the wait is up
        started = time.monotonic()
        assert launch.trainer_exited(proc, within=30)
        assert time.monotonic() - started < 10  # not the whole 30 s
    finally:
        proc.kill()
        proc.wait()
