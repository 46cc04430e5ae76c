"""A job's lifecycle: every change of a job's status is one compare-and-set function here.

Each is a conditional UPDATE of the job's row that names the status (and holder) it expects, so two
writers that race (a worker claiming, a client cancelling, a reconciler requeueing) never both win: the
loser sees its expectation gone and decides again from what it finds. The callers write the events
(they know why); the worker calls these, it writes no status of its own.

    claim / claim_stale / claim_fair   queued (or running under a stale lease) -> running, held by a worker
    heartbeat                          keeps a held running job's lease alive
    finish                             running (held) -> succeeded | failed | cancelled
    release                            clears the holder of a job that has ended
    requeue                            back to queued (or to paused when a pause was requested)
    fail                               -> failed (a run that died once too often)
    move                               a client's cancel, pause or resume (service/jobs/transitions.py)

The DB lease is what makes a job single: the job row, not the broker, decides which worker runs it. A
worker claims a job with one conditional UPDATE, keeps the lease alive with heartbeats and finishes it
only while it still holds it, so a redelivered Celery message never starts a second live copy. Which
queued job a worker claims is the fair-share decision (`claim_fair`, service/jobs/fairness.py): a run
message only says that some job waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import ColumnElement, func, or_, select, update
from sqlalchemy.orm import Session

from service.db import session_scope
from service.ids import now
from service.jobs.dispatch import send_after_commit
from service.jobs.fairness import fair_order
from service.jobs.schemas import TERMINAL_STATUSES
from service.models import Job, Tenant


def claim(session: Session, *, job_id: str, worker_id: str, lease_timeout: float) -> bool:
    """Claim this job: queued, or running under a stale lease (a takeover)."""
    t = time.time()
    stale = (Job.status == "running") & or_(Job.heartbeat_at.is_(None), Job.heartbeat_at < t - lease_timeout)
    return _take(session, job_id=job_id, worker_id=worker_id, runnable=or_(Job.status == "queued", stale))


def claim_stale(session: Session, *, job_id: str, worker_id: str, lease_timeout: float) -> bool:
    """Take over this job if it is running under a stale lease (its worker died, its message came back)."""
    t = time.time()
    stale = (Job.status == "running") & or_(Job.heartbeat_at.is_(None), Job.heartbeat_at < t - lease_timeout)
    return _take(session, job_id=job_id, worker_id=worker_id, runnable=stale)


def _take(session: Session, *, job_id: str, worker_id: str, runnable: ColumnElement[bool]) -> bool:
    t = time.time()
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, runnable)
        .values(status="running", worker_id=worker_id, heartbeat_at=t, attempts=Job.attempts + 1)
        .execution_options(synchronize_session=False)
    )
    claimed = bool(getattr(result, "rowcount", 0) == 1)
    if claimed:
        session.execute(
            update(Job)
            .where(Job.id == job_id, Job.started_at.is_(None))
            .values(started_at=now())
            .execution_options(synchronize_session=False)
        )
    return claimed


def heartbeat(session: Session, *, job_id: str, worker_id: str) -> bool:
    """Refresh the lease; False when the job is no longer ours to run (cancelled, finished, taken over)."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.worker_id == worker_id, Job.status == "running")
        .values(heartbeat_at=time.time())
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(result, "rowcount", 0) == 1)


def finish(session: Session, *, job_id: str, worker_id: str, status: str, **values: Any) -> bool:
    """Move a job we hold to a terminal state; False if someone (a cancel) got there first."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.worker_id == worker_id, Job.status == "running")
        .values(status=status, finished_at=now(), **values)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(result, "rowcount", 0) == 1)


def release(session: Session, *, job_id: str, worker_id: str) -> bool:
    """Our trainer has exited and the job ended (a cancel, decided by the API while it ran): clear the
    holder, which tells streams that nothing more will be written (service/jobs/stream.py)."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.worker_id == worker_id, Job.status.in_(TERMINAL_STATUSES))
        .values(worker_id=None)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(result, "rowcount", 0) == 1)


def stale_running_jobs(session: Session, *, lease_timeout: float) -> list[str]:
    cutoff = time.time() - lease_timeout
    stmt = select(Job.id).where(
        Job.status == "running", or_(Job.heartbeat_at.is_(None), Job.heartbeat_at < cutoff)
    )
    return list(session.scalars(stmt))


def claim_fair(
    *,
    worker_id: str,
    queues: Sequence[str],
    max_running_per_tenant: int,
    accept: Callable[[str], bool] | None = None,
) -> str | None:
    """Claim the fairest queued job of `queues` (service/jobs/fairness.py) for `worker_id`; its id, or
    None when no such job may start (none queued, or every waiting tenant at its running-job limit).
    With `accept`, the fairest job that may start is claimed only if `accept(its id)`, else none: a
    worker that can take only some jobs now (worker/shared_runs.py) does not pass over fairer ones.

    Each attempt is its own transaction: a conditional UPDATE (still queued) lets one worker win a job;
    with a limit the tenant's row is locked first (SELECT ... FOR UPDATE), so two workers cannot both
    start a tenant's last allowed job (the count is read after the lock, seeing the other's commit).
    """
    with session_scope() as session:
        order = fair_order(session, queues=queues)
    at_limit: set[str] = set()
    for waiting in order:
        if waiting.tenant_id in at_limit:
            continue
        with session_scope() as session:
            if max_running_per_tenant > 0:
                session.execute(select(Tenant.id).where(Tenant.id == waiting.tenant_id).with_for_update())
                running = session.scalar(
                    select(func.count()).where(Job.tenant_id == waiting.tenant_id, Job.status == "running")
                )
                if (running or 0) >= max_running_per_tenant:
                    at_limit.add(waiting.tenant_id)
                    continue
            if accept is not None and not accept(waiting.job_id):
                return None
            if _take(session, job_id=waiting.job_id, worker_id=worker_id, runnable=Job.status == "queued"):
                return waiting.job_id
    return None


def queued_values(t: float) -> dict[str, Any]:
    """A job entering `queued` now: no lease holder, its message sent at `t` (`send_after_commit`)."""
    return {"status": "queued", "worker_id": None, "heartbeat_at": None, "queued_at": t, "dispatched_at": t}


def requeue(
    session: Session, *, job_id: str, expect: ColumnElement[bool], restart: bool = False
) -> str | None:
    """Move the job back to the queue if `expect` (e.g. "running, held by me") still holds.

    Returns the new status: `queued` (its run message goes out after commit), `paused` when a pause was
    requested meanwhile, or None when `expect` no longer holds (someone else moved the job). `restart`
    counts a crash restart (bounded by settings.max_restarts; the caller checks the bound in `expect`).
    The caller writes the event: it knows why.
    """
    t = time.time()
    charged: dict[str, Any] = {"restarts": Job.restarts + 1} if restart else {}
    paused = session.execute(
        update(Job)
        .where(Job.id == job_id, expect, Job.pause_requested.is_(True))
        .values(status="paused", pause_requested=False, worker_id=None, heartbeat_at=None, **charged)
        .execution_options(synchronize_session=False)
    )
    if getattr(paused, "rowcount", 0) == 1:
        return "paused"
    queued = session.execute(
        update(Job)
        .where(Job.id == job_id, expect)
        .values(**queued_values(t), **charged)
        .execution_options(synchronize_session=False)
    )
    if getattr(queued, "rowcount", 0) != 1:
        return None
    send_after_commit(
        session, job_id, t, queue=session.execute(select(Job.queue).where(Job.id == job_id)).scalar_one()
    )
    return "queued"


def move(session: Session, job: Job, *, expect: tuple[str, ...], **values: Any) -> bool:
    """Compare-and-set the job's row (a worker may move it at the same moment); True if we moved it."""
    result = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.status.in_(expect))
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(result, "rowcount", 0) == 1)


def fail(session: Session, *, job_id: str, expect: ColumnElement[bool], error: dict[str, Any]) -> bool:
    """Fail the job with `error` if `expect` still holds (a run that died once too often); False if
    someone else moved it first. The caller writes the event."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, expect)
        .values(status="failed", finished_at=now(), error=error, pause_requested=False)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(result, "rowcount", 0) == 1)
