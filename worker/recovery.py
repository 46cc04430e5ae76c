"""A running job's lease (``renew_lease``), and what happens to a job whose run ended without an
outcome: a crash is a bounded restart, a shutdown or a pause is a hand-back. Both go back to the queue
through service.jobs.lifecycle.requeue, and resume from the job's latest checkpoint
(worker/job_process.py).
"""

from __future__ import annotations

import logging
import signal

from sqlalchemy import ColumnElement
from sqlalchemy.orm import Session

from service.config import Settings
from service.db import session_scope
from service.jobs import lifecycle, repository
from service.jobs.events import add_event, state_event
from service.models import Job
from worker.outage import is_outage

log = logging.getLogger("tunehouse.worker")

# SIGKILL is what the kernel's OOM killer sends; say so, it is the likely cause
_SIGNAL_HINTS = {signal.SIGKILL: " (out of memory, or killed by an operator)"}


def renew_lease(job_id: str, *, worker_id: str) -> bool | None:
    """Heartbeat the job's lease: True while this worker holds it, False once it is lost (cancelled,
    taken over), None when the database is down (the trainer buffers meanwhile; beyond
    `lease_timeout_seconds` another worker may take the job over)."""
    try:
        with session_scope() as session:
            return lifecycle.heartbeat(session, job_id=job_id, worker_id=worker_id)
    except Exception as exc:
        if not is_outage(exc):
            raise
        log.warning("job %s: heartbeat failed, database unavailable", job_id)
        return None


def held_by(worker_id: str) -> ColumnElement[bool]:
    """The job is running under this worker's lease."""
    return (Job.status == "running") & (Job.worker_id == worker_id)


def describe_exit(returncode: int, process: str = "the trainer process") -> str:
    """How `process` ended, as a job's event says it: "<process> was killed by SIGKILL (...)"."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return f"{process} was killed by signal {-returncode}"
        return f"{process} was killed by {sig.name}{_SIGNAL_HINTS.get(sig, '')}"
    return f"{process} exited with code {returncode}"


def restart_or_fail(
    session: Session, *, job_id: str, expect: ColumnElement[bool], cause: str, max_restarts: int
) -> str | None:
    """A run of the job died: queue it again (a charged restart) or, once it has been restarted
    `max_restarts` times, fail it with fault `system`. Returns the new status; None if `expect` no
    longer holds (the job was cancelled or taken over meanwhile: nothing to do)."""
    status = lifecycle.requeue(
        session, job_id=job_id, expect=expect & (Job.restarts < max_restarts), restart=True
    )
    if status is not None:
        n = repository.restarts_of(session, job_id)
        then = "it resumes from its latest checkpoint" if status == "queued" else "it was being paused"
        add_event(
            session,
            job_id,
            f"Job restarted ({n} of {max_restarts}): {cause}; {then}",
            level="warn",
            data=state_event(status, "job.restarted", cause=cause, restart=n, max_restarts=max_restarts),
        )
        return status
    message = f"{cause}; gave up after {max_restarts} restart(s)"
    error = {"code": "internal_error", "message": message, "param": None, "fault": "system"}
    if not lifecycle.fail(session, job_id=job_id, expect=expect, error=error):
        return None
    add_event(
        session,
        job_id,
        f"Job failed: {message}",
        level="error",
        data=state_event("failed", code="internal_error", fault="system"),
    )
    return "failed"


def hand_back(session: Session, *, job_id: str, worker_id: str, why: str) -> str | None:
    """Our run stopped on purpose (a pause, the worker shutting down): back to the queue, or to `paused`
    if a pause was requested. Not a restart: nothing is charged."""
    status = lifecycle.requeue(session, job_id=job_id, expect=held_by(worker_id))
    if status == "paused":
        add_event(
            session,
            job_id,
            f"Job paused: {why}; resume it to continue",
            data=state_event("paused"),
        )
    elif status == "queued":
        add_event(
            session,
            job_id,
            f"Job handed back to the queue: {why}",
            data=state_event("queued", "job.handed_back", worker=worker_id),
        )
    return status


def run_ended_without_outcome(
    job_id: str, *, worker_id: str, stopping: bool, what: str, cause: str, settings: Settings
) -> None:
    """The trainer (`what`) of a job we hold ended without recording its outcome. The worker was
    `stopping` (SIGTERM) and the trainer did not checkpoint within the grace: a hand-back, from the
    previous checkpoint; else it died (`cause`): a charged restart, or a failure past max_restarts."""
    with session_scope() as session:
        if stopping:
            hand_back(
                session,
                job_id=job_id,
                worker_id=worker_id,
                why=f"worker {worker_id} shut down and {what} did not checkpoint within "
                f"{settings.shutdown_grace_seconds:.0f}s; it resumes from its previous checkpoint",
            )
        else:
            restart_or_fail(
                session,
                job_id=job_id,
                expect=held_by(worker_id),
                cause=cause,
                max_restarts=settings.max_restarts,
            )


def release_and_status(job_id: str, *, worker_id: str) -> str | None:
    """Our run of the job is over: clear the lease holder (lifecycle.release), then the job's status."""
    try:
        with session_scope() as session:
            lifecycle.release(session, job_id=job_id, worker_id=worker_id)
    except Exception as exc:  # the job's streams then end a lease timeout after its last heartbeat
        if not is_outage(exc):
            raise
        log.warning("job %s: could not release it, database unavailable", job_id)
    with session_scope() as session:
        return repository.status_of(session, job_id)
