"""The DB lease: the job row, not the broker, decides which worker runs a job.

A worker claims a job with one conditional UPDATE (queued, or running with a stale heartbeat), keeps
the lease alive with heartbeats, and finishes it only while it still holds it. A redelivered Celery
message therefore never starts a second live copy: the claim fails while the first copy heartbeats.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import or_, update
from sqlalchemy.orm import Session

from service.ids import now
from service.models import Job


def claim(session: Session, *, job_id: str, worker_id: str, lease_timeout: float) -> bool:
    t = time.time()
    result = session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            or_(
                Job.status == "queued",
                (Job.status == "running")
                & or_(Job.heartbeat_at.is_(None), Job.heartbeat_at < t - lease_timeout),
            ),
        )
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


def stale_running_jobs(session: Session, *, lease_timeout: float) -> list[str]:
    from sqlalchemy import select

    cutoff = time.time() - lease_timeout
    stmt = select(Job.id).where(
        Job.status == "running", or_(Job.heartbeat_at.is_(None), Job.heartbeat_at < cutoff)
    )
    return list(session.scalars(stmt))
