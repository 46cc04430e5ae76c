"""Runs one job: claim the lease, start a fresh trainer process (or hand the job to the worker's spare
one, already started: worker/spare_trainer.py), heartbeat while it lives.

Why a child process per job: accelerate and CUDA keep process-global state, a trainer that crashes
(or is OOM-killed) must not take the worker with it, and the parent can still record what happened.
A trainer that dies is a restart from the job's latest checkpoint, within settings.max_restarts
(worker/recovery.py).

Shutdown: when the worker is asked to stop (SIGTERM/SIGINT: Celery's warm shutdown, which stops taking
new messages), `request_shutdown` forwards SIGTERM to the trainer, which checkpoints at its next step
and hands the job back to the queue (worker/job_process.py), uncharged. A trainer that has not done so
within settings.shutdown_grace_seconds is killed and the job handed back here; it then resumes from
its previous checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

from service.config import get_settings
from service.db import session_scope
from service.jobs import lifecycle, repository
from service.jobs.events import add_event, state_event
from service.jobs.resources import job_resources
from service.jobs.spec import load_method, quantization_of
from service.queue import RUN_JOB_TASK, send_task
from worker.launch import (
    driver_command,
    kill_trainer,
    start_trainer,
    trainer_command,
    trainer_exited,
    worker_device,
    worker_queues,
)
from worker.recovery import describe_exit, release_and_status, renew_lease, run_ended_without_outcome
from worker.shared_runs import run_shared, share_key
from worker.spare_trainer import SpareTrainer

log = logging.getLogger("tunehouse.worker")

# how long a child may keep running after we lost the lease (cancel, takeover) before we kill it
LOST_LEASE_GRACE_SECONDS = 30.0

_shutdown = threading.Event()
# the worker's spare trainer (worker/spare_trainer.py), once `keep_a_spare_trainer` turned it on
_spare: SpareTrainer | None = None


def request_shutdown() -> None:
    """The worker is stopping: hand the running job back (called from Celery's shutdown signal)."""
    _shutdown.set()


def keep_a_spare_trainer() -> None:
    """From now on this worker keeps a trainer process started ahead of its next one-rank job (called
    when the worker is ready, if `settings.spare_trainer`)."""
    global _spare
    _spare = _spare or SpareTrainer()
    _spare.start()


def stop_spare_trainer() -> None:
    if _spare is not None:
        _spare.stop()


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def supervise_job(job_id: str, *, worker_id: str | None = None) -> str | None:
    """Take one run message: run the fairest queued job, then the next fairest, until none may start.

    The message is a token that some job waits (service/jobs/fairness.py), so the job run may be
    another than `job_id`: that one's own message later starts another job in turn, or finds none and
    is dropped. A message for a running job whose lease went stale takes that job over instead. Going
    on to the next job when one ends is what starts a job that waited for its tenant's limit (its own
    token may have found the tenant full and been dropped); the reconciler re-sends as a backstop.
    Returns the final status of `job_id` if this call ran it, else None.
    """
    settings = get_settings()
    worker_id = worker_id or default_worker_id()
    with session_scope() as session:
        queue = repository.queue_of(session, job_id)
        if queue is None:
            return None
        if _shutdown.is_set():
            # shutting down (a message raced the stop): pass the token on to another worker
            send_task(RUN_JOB_TASK, [job_id], queue=queue)
            return None
        taken_over = lifecycle.claim_stale(
            session, job_id=job_id, worker_id=worker_id, lease_timeout=settings.lease_timeout_seconds
        )
    ran: str | None = None
    current = job_id if taken_over else _claim_next(worker_id)
    if current is None:
        log.info(
            "run message for %s: no job of queues %s may start; dropped", job_id, worker_queues(settings)
        )
    while current is not None:
        statuses = _run_claimed(current, worker_id=worker_id)
        ran = statuses.get(job_id, ran)
        if _shutdown.is_set():
            break
        current = _claim_next(worker_id)
    return ran


def _claim_next(worker_id: str) -> str | None:
    settings = get_settings()
    return lifecycle.claim_fair(
        worker_id=worker_id,
        queues=worker_queues(settings),
        max_running_per_tenant=settings.max_running_jobs_per_tenant,
    )


def _announce_start(job_id: str, *, worker_id: str, how: str | None = None) -> None:
    """The job's "Job started" event: where, which attempt, and `how` (on a shared base)."""
    settings = get_settings()
    with session_scope() as session:
        attempt, resources = repository.attempt_and_resources(session, job_id)
        need = job_resources(resources)
        gpus = need.ranks
        if need.multi_node:
            on = (
                f"Ray cluster {settings.ray_address} (driver: worker {worker_id}), "
                f"{need.nodes} nodes x {need.per_node} ranks"
            )
        else:
            on = f"worker {worker_id} [{worker_device().describe()}]"
            on += f", {gpus} ranks" if gpus > 1 else ""
        add_event(
            session,
            job_id,
            f"Job started on {on} (attempt {attempt})" + (f", {how}" if how else ""),
            data=state_event(
                "running",
                worker=worker_id,
                device=worker_device().kind,
                device_name=worker_device().name,
                attempt=attempt,
                ranks=gpus,
                nodes=need.nodes,
                shared=how is not None,
            ),
        )


def _run_claimed(job_id: str, *, worker_id: str) -> dict[str, str | None]:
    """Run a job this worker has claimed to its end (or hand-back), alone or with the jobs that join it on
    a shared base (worker/shared_runs.py); returns the status then of each job run."""
    settings = get_settings()
    key = share_key(job_id) if settings.shared_base_jobs > 1 else None
    if key is not None:
        statuses = run_shared(
            job_id,
            key,
            worker_id=worker_id,
            shutdown=_shutdown,
            announce=lambda joining, how: _announce_start(joining, worker_id=worker_id, how=how),
            spare=_spare,
        )
        if _spare is not None and not _shutdown.is_set():
            _spare.start()  # the spare became the shared trainer: start the next
        return statuses
    return {job_id: _run_alone(job_id, worker_id=worker_id)}


def _run_alone(job_id: str, *, worker_id: str) -> str | None:
    """Run the job in a trainer process of its own; returns its status then."""
    settings = get_settings()
    _announce_start(job_id, worker_id=worker_id)
    with session_scope() as session:
        resources = repository.attempt_and_resources(session, job_id)[1]
        # only a QLoRA job's trainer imports bitsandbytes (worker/launch.py WITHOUT_BITSANDBYTES), so
        # only a fresh trainer runs it: the spare started without
        quantized = quantization_of(load_method(repository.method_of(session, job_id))) is not None
    need = job_resources(resources)
    gpus = need.ranks

    spare_fits = _spare is not None and gpus == 1 and not quantized
    proc = _spare.take(job_id, worker_id) if _spare is not None and spare_fits else None
    if proc is None:
        command = (
            driver_command(job_id, worker_id)
            if need.multi_node
            else trainer_command(job_id, worker_id, ranks=gpus, grace_seconds=settings.shutdown_grace_seconds)
        )
        proc = start_trainer(command, quantized=quantized)
    lost_since: float | None = None
    stop_asked: float | None = None
    last_beat = time.monotonic()
    while not trainer_exited(proc, within=0.2):
        if _shutdown.is_set() and stop_asked is None:
            log.warning("worker shutting down: asking the trainer of %s to checkpoint and hand back", job_id)
            proc.send_signal(signal.SIGTERM)
            stop_asked = time.monotonic()
        if stop_asked is not None and time.monotonic() - stop_asked > settings.shutdown_grace_seconds:
            log.warning("job %s: the trainer did not hand back within the grace period; killing it", job_id)
            kill_trainer(proc)
            break
        if time.monotonic() - last_beat < settings.heartbeat_seconds:
            continue
        last_beat = time.monotonic()
        if lost_since is None or time.time() - lost_since < LOST_LEASE_GRACE_SECONDS:
            if renew_lease(job_id, worker_id=worker_id) is False and lost_since is None:
                lost_since = time.time()
        else:
            log.warning(
                "job %s: lease lost %.0fs ago and the trainer is still running; killing it",
                job_id,
                LOST_LEASE_GRACE_SECONDS,
            )
            kill_trainer(proc)
    if _spare is not None and not _shutdown.is_set():
        _spare.start()  # it imports while this job's outcome is recorded and the next one claimed
    if proc.returncode != 0:
        # the trainer records its own outcome and exits 0; anything else ended it from outside
        run_ended_without_outcome(
            job_id,
            worker_id=worker_id,
            stopping=stop_asked is not None,
            what="the trainer",
            cause=describe_exit(proc.returncode),
            settings=settings,
        )
    return release_and_status(job_id, worker_id=worker_id)
