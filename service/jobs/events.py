"""Job events: the human-readable log of a job, written by the API and the worker alike; the
state changes among them also queue their webhooks (service/webhooks/events.py)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from service.ids import new_id
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
    if data is not None:
        # a state change or a checkpoint also queues its webhooks, in this same transaction
        enqueue(session, job_id=job_id, kind=data.get("kind"), data=data)
    return event


def state_event(status: str, kind: str | None = None, **data: Any) -> dict[str, Any]:
    """Event data of a state change: `kind` names the transition (job.paused, job.restarted, ...)."""
    return {"kind": kind or f"job.{status}", "status": status, **data}
