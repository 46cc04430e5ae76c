"""Which job events become webhook events, and the outbox write that records them.

Every state change of a job already writes a job event whose `data.kind` names the transition
(service/jobs/service.py, worker/); `service.jobs.events.add_event` calls `enqueue` with it, in the
same session, so a webhook is queued in the very transaction that changes the job: committed together
or not at all, and nothing is lost when a process dies after the commit (the workers' delivery loop,
worker/webhooks.py, sends what is queued).
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.ids import new_id, now
from service.models import Job, WebhookDelivery, WebhookEndpoint

JOB_STATUS_EVENTS = tuple(
    f"fine_tuning.job.{s}" for s in ("queued", "running", "succeeded", "failed", "cancelled", "paused")
)
CHECKPOINT_EVENT = "fine_tuning.job.checkpoint.created"
# every type an endpoint can subscribe to
EVENT_TYPES: tuple[str, ...] = (*JOB_STATUS_EVENTS, CHECKPOINT_EVENT)

# Job-event kinds that move the job into `data.status` (a resume, a hand-back or a restart is a move
# into `queued`; a restart while pausing into `paused`). A pause requested or withdrawn is not a move.
_TRANSITIONS = frozenset(
    {
        "job.queued",
        "job.resumed",
        "job.handed_back",
        "job.restarted",
        "job.running",
        "job.succeeded",
        "job.failed",
        "job.cancelled",
        "job.paused",
    }
)
CHECKPOINT_KIND = "checkpoint.created"


def webhook_event(kind: str | None, data: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(event type, extra `data` fields) for a job event, or None if it is no webhook event."""
    if kind in _TRANSITIONS:
        return f"fine_tuning.job.{data['status']}", {}
    if kind == CHECKPOINT_KIND:
        return CHECKPOINT_EVENT, {"checkpoint_id": data["checkpoint_id"], "step_number": data["step"]}
    return None


def enqueue(session: Session, *, job_id: str, kind: str | None, data: dict[str, Any]) -> int:
    """Queue the webhook deliveries of one job event for every endpoint of the job's tenant that
    subscribes to it. Returns how many were queued."""
    event = webhook_event(kind, data)
    if event is None:
        return 0
    event_type, extra = event
    endpoints = session.scalars(
        select(WebhookEndpoint).join(Job, Job.tenant_id == WebhookEndpoint.tenant_id).where(Job.id == job_id)
    ).all()
    wanted = [e for e in endpoints if e.events is None or event_type in e.events]
    if not wanted:
        return 0
    # OpenAI's webhook event object; `data.id` is the job, as in OpenAI's fine_tuning.job.* events
    payload = {
        "object": "event",
        "id": new_id("evt"),
        "type": event_type,
        "created_at": now(),
        "data": {"id": job_id, **extra},
    }
    t = time.time()
    for endpoint in wanted:
        session.add(
            WebhookDelivery(
                id=new_id("whdel"),
                endpoint_id=endpoint.id,
                event_id=payload["id"],
                event_type=event_type,
                payload=payload,
                status="pending",
                attempts=0,
                next_attempt_at=t,
            )
        )
    return len(wanted)
