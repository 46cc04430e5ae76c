"""Job events: the human-readable log of a job, written by the API and the worker alike; the
state changes among them also queue their webhooks (service/webhooks/events.py), and every event but a
step's wakes the job's live streams once it is committed (service/jobs/live.py)."""

from __future__ import annotations

from typing import Any

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
) -> JobEvent:
    event = JobEvent(id=new_id("ftevent"), job_id=job_id, message=message, level=level, type=type, data=data)
    session.add(event)
    if type != "metrics":  # a step's event: its row went live already (service/jobs/live.py)
        nudge_after_commit(session, job_id)
    if data is not None:
        # a state change or a checkpoint also queues its webhooks, in this same transaction
        enqueue(session, job_id=job_id, kind=data.get("kind"), data=data)
    return event


def state_event(status: str, kind: str | None = None, **data: Any) -> dict[str, Any]:
    """Event data of a state change: `kind` names the transition (job.paused, job.restarted, ...)."""
    return {"kind": kind or f"job.{status}", "status": status, **data}
