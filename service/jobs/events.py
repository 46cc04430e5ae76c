"""Job events: the human-readable log of a job, written by the API and the worker alike; the
state changes among them also queue their webhooks (service/webhooks/events.py), and every event but a
step's wakes the job's live streams once it is committed (service/jobs/live.py)."""

from __future__ import annotations

import hashlib
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.ids import new_id
from service.jobs.live import nudge_after_commit
from service.models import JobEvent
from service.webhooks.events import enqueue


def add_event(
    session: Session,
    job_id: str,
    message: str,
    *,
    level: str = "info",
    type: str = "message",
    data: dict[str, Any] | None = None,
    event_id: str | None = None,
) -> JobEvent:
    event = JobEvent(
        id=event_id or new_id("ftevent"), job_id=job_id, message=message, level=level, type=type, data=data
    )
    session.add(event)
    if type != "metrics":  # a step's event: its row went live already (service/jobs/live.py)
        nudge_after_commit(session, job_id)
    if data is not None:
        # a state change or a checkpoint also queues its webhooks, in this same transaction
        enqueue(session, job_id=job_id, kind=data.get("kind"), data=data)
    return event


def once_id(job_id: str, moment: str) -> str:
    """The id of the event a job records once for `moment` (e.g. "epoch-2"): derived, not random, so a
    run restarted from a checkpoint before that moment, which lives it again, or a write retried after
    its commit's answer was lost (a database outage), finds the id taken. Events page by `seq`
    (service/jobs/service.py), so an id that is not time-ordered orders nothing wrong."""
    return "ftevent-" + hashlib.sha256(f"{job_id}/{moment}".encode()).hexdigest()[:24]


def add_event_once(
    session: Session, job_id: str, moment: str, message: str, *, data: dict[str, Any] | None = None
) -> JobEvent | None:
    """`add_event` unless the job has recorded `moment` already (then None): the metric rows' idempotence
    (worker/reporter.py `_write_rows`) for the events that are not a step's. One writer per job (the
    lease), so a read before the insert suffices; the unique id catches anything else."""
    event_id = once_id(job_id, moment)
    if session.scalar(select(JobEvent.seq).where(JobEvent.id == event_id)) is not None:
        return None
    return add_event(session, job_id, message, data=data, event_id=event_id)


def state_event(status: str, kind: str | None = None, **data: Any) -> dict[str, Any]:
    """Event data of a state change: `kind` names the transition (job.paused, job.restarted, ...)."""
    return {"kind": kind or f"job.{status}", "status": status, **data}
