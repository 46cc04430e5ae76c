"""A worker's LoRA jobs on one base model, trained together in one process that holds the base once.

When the job a worker claims can share its base (``share_key``: a LoRA adapter, quantized base or not,
one rank, any method, a text model) and `settings.shared_base_jobs` > 1, the worker
starts a shared-base trainer (worker/shared_base_host.py) for it instead of a lone trainer, and while
that runs it keeps claiming: whenever the fairest job that may start has the same key and the process
has room, that job joins it without restarting the others. A fairer job with another key is not passed
over: the process takes no new job then, drains, and the worker claims as usual (service/jobs/fairness.py
decides the order; tenants' limits hold as for any claim).

Each job keeps its own lease, heartbeats and outcome, exactly as with a trainer of its own: pause,
cancel, failure or success of one leaves the others running; a lost lease stops that job alone; the
process dying (OOM, kill) restarts each job from its own latest checkpoint, charged as a crash.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from service.base_models.modalities import model_modalities
from service.config import get_settings
from service.db import session_scope
from service.jobs import lifecycle, repository
from service.jobs.resources import job_resources
from service.jobs.spec import load_method, quantization_of
from trainers.modalities import IMAGE
from worker.launch import kill_trainer, shared_base_command, start_trainer, worker_queues
from worker.recovery import describe_exit, release_and_status, renew_lease, run_ended_without_outcome
from worker.spare_trainer import SpareTrainer

log = logging.getLogger("tunehouse.worker")

CLAIM_EVERY_SECONDS = 1.0  # how often a running shared process looks for a job to take in
LOST_LEASE_GRACE_SECONDS = 30.0  # as worker/supervisor.py (see `_heartbeat`)


@dataclass(frozen=True)
class ShareKey:
    """What jobs must have in common to train on one copy of a base: the model, and the settings that
    decide how the base is held (its dtype through the precision, its quantization, the kernels
    installed on it)."""

    model: str
    mixed_precision: str
    quantization: str | None
    gradient_checkpointing: bool


def share_key(job_id: str) -> ShareKey | None:
    """This job's ``ShareKey``, or None if it trains alone (full weights, several ranks)."""
    with session_scope() as session:
        job = repository.job(session, job_id)
        if job is None:
            return None
        model, stored_method, resources = job.model, job.method, job.resources
        # a vision-language base loads through its processor, alone (trainers.modeling.vision)
        takes = model_modalities(session, get_settings(), tenant_id=job.tenant_id, name=model)
        if takes is not None and IMAGE in takes:
            return None
    method = load_method(stored_method)
    need = job_resources(resources)
    if need.ranks > 1 or need.multi_node:
        return None
    hp = getattr(getattr(method, method.type), "hyperparameters", None)
    if hp is None or not getattr(hp, "lora", False):
        return None
    return ShareKey(
        model,
        getattr(hp, "mixed_precision", "auto"),
        quantization_of(method),
        getattr(hp, "gradient_checkpointing", False),
    )


@dataclass
class _Member:
    lost_since: float | None = None  # when its lease was found lost
    stop_sent: bool = False


def run_shared(
    first: str,
    key: ShareKey,
    *,
    worker_id: str,
    shutdown: threading.Event,
    announce: Callable[[str, str], None],
    spare: SpareTrainer | None,
) -> dict[str, str | None]:
    """Run `first` (claimed) on a shared base, taking in the jobs with its `key` as they become the
    fairest, until none is left running; returns the final status of every job run. `announce(job_id,
    how)` writes a job's start event. The worker's `spare` trainer becomes the shared one if there is one."""
    with tempfile.TemporaryDirectory(prefix="tunehouse-shared-") as folder:
        fifo = os.path.join(folder, "notices")
        os.mkfifo(fifo)
        # opened for reading and writing: the open does not wait for the trainer, and the reader ends on
        # the empty line written once the trainer has exited
        fd = os.open(fifo, os.O_RDWR)
        notices: queue.Queue[tuple[str, int]] = queue.Queue()
        reader = threading.Thread(target=_read_notices, args=(fd, notices), daemon=True)
        reader.start()
        try:
            # the spare runs without bitsandbytes (worker/launch.py): a quantized base needs a fresh one
            quantized = key.quantization is not None
            proc = spare.take_as_shared_base(worker_id, fifo) if spare is not None and not quantized else None
            if proc is None:
                proc = start_trainer(
                    shared_base_command(worker_id, fifo), stdin=subprocess.PIPE, quantized=quantized
                )
            return _drive(
                proc, first, key, notices, worker_id=worker_id, shutdown=shutdown, announce=announce
            )
        finally:
            os.write(fd, b"\n")
            reader.join(timeout=5)


def _drive(
    proc: subprocess.Popen[bytes],
    first: str,
    key: ShareKey,
    notices: queue.Queue[tuple[str, int]],
    *,
    worker_id: str,
    shutdown: threading.Event,
    announce: Callable[[str, str], None],
) -> dict[str, str | None]:
    settings = get_settings()
    members: dict[str, _Member] = {}
    statuses: dict[str, str | None] = {}
    assert proc.stdin is not None

    def send(line: str) -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(f"{line}\n".encode())
            proc.stdin.flush()
        except OSError:  # it died: the loop below finds it exited
            pass

    def join(job_id: str) -> None:
        others = len(members)
        announce(job_id, f"sharing one copy of its base model with {others} other job(s)")
        members[job_id] = _Member()
        send(f"run {job_id}")

    join(first)
    stop_asked: float | None = None
    last_beat = last_claim = time.monotonic()
    while True:
        try:
            job_id, code = notices.get(timeout=0.2)
            members.pop(job_id, None)
            statuses[job_id] = _ended(job_id, code, worker_id=worker_id)
            continue
        except queue.Empty:
            pass
        if proc.poll() is not None:
            break
        if not members:
            proc.stdin.close()
            proc.wait()
            break
        now = time.monotonic()
        if shutdown.is_set() and stop_asked is None:
            log.warning("worker shutting down: asking the shared-base jobs %s to hand back", list(members))
            proc.send_signal(signal.SIGTERM)
            stop_asked = now
        if stop_asked is not None and now - stop_asked > settings.shutdown_grace_seconds:
            log.warning("shared-base jobs did not hand back within the grace period; killing their process")
            kill_trainer(proc)
            break
        if (
            stop_asked is None
            and len(members) < settings.shared_base_jobs
            and now - last_claim >= CLAIM_EVERY_SECONDS
        ):
            last_claim = now
            joining = lifecycle.claim_fair(
                worker_id=worker_id,
                queues=worker_queues(settings),
                max_running_per_tenant=settings.max_running_jobs_per_tenant,
                accept=lambda candidate: share_key(candidate) == key,
            )
            if joining is not None:
                join(joining)
        if now - last_beat >= settings.heartbeat_seconds:
            last_beat = now
            if _heartbeat(members, worker_id=worker_id, send=send):
                kill_trainer(proc)
                break
    # the process ended: every job it did not report ended with it
    proc.wait()
    while not notices.empty():
        job_id, code = notices.get()
        members.pop(job_id, None)
        statuses[job_id] = _ended(job_id, code, worker_id=worker_id)
    for job_id in members:
        run_ended_without_outcome(
            job_id,
            worker_id=worker_id,
            stopping=stop_asked is not None,
            what="the shared-base trainer",
            cause=describe_exit(proc.returncode, "its shared-base trainer"),
            settings=settings,
        )
        statuses[job_id] = release_and_status(job_id, worker_id=worker_id)
    return statuses


def _read_notices(fd: int, notices: queue.Queue[tuple[str, int]]) -> None:
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        for line in pipe:
            words = line.decode().split()
            if not words:
                return  # the end (run_shared)
            notices.put((words[0], int(words[1])))


def _heartbeat(members: dict[str, _Member], *, worker_id: str, send: Callable[[str], None]) -> bool:
    """Refresh every member's lease. A member whose lease is lost (cancelled, taken over) sees it itself
    at its next control poll and stops (worker/reporter.py should_stop: "Training stopped ..."), as a
    lone trainer does; one still running `LOST_LEASE_GRACE_SECONDS` later is asked to stop, and one
    running twice that long makes this return True: the process must be killed (its other jobs restart
    from their checkpoints), as a lone trainer is killed after the same grace."""
    for job_id, member in members.items():
        if member.lost_since is not None:
            lost_for = time.time() - member.lost_since
            if lost_for > 2 * LOST_LEASE_GRACE_SECONDS:
                log.warning("job %s: lease lost and still running; killing its shared-base trainer", job_id)
                return True
            if lost_for > LOST_LEASE_GRACE_SECONDS and not member.stop_sent:
                member.stop_sent = True
                send(f"stop {job_id}")
            continue
        if renew_lease(job_id, worker_id=worker_id) is False:
            member.lost_since = time.time()
    return False


def _ended(job_id: str, code: int, *, worker_id: str) -> str | None:
    """A job's thread ended: with its outcome recorded (0), or dead before (a crash: restart it)."""
    if code != 0:
        run_ended_without_outcome(
            job_id,
            worker_id=worker_id,
            stopping=False,
            what="its thread",
            cause="its thread in the shared-base trainer died",
            settings=get_settings(),
        )
    return release_and_status(job_id, worker_id=worker_id)
