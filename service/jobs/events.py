"""Job events: the human-readable log of a job, written by the API and the worker alike."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from service.ids import new_id
from service.models import JobEvent


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
    return event
