"""A job's status changes that a client asks for: cancel, pause and resume.

Each is a compare-and-set on the job's row (`_move`): a worker may move the same job at the same moment
(claim it, finish it, carry out a pause), and whichever write lands second sees the status it expected
gone. The loser re-reads the row and decides again from the status it finds, so a request never
overwrites a worker's transition and never answers from a status that is no longer true.

    queued  --cancel--> cancelled       queued  --pause--> paused          paused --resume--> queued
    running --cancel--> cancelled       running --pause--> running + pause_requested (the trainer
    paused  --cancel--> cancelled                          checkpoints, then the worker sets paused)
    queued/running + pause_requested --resume--> the request withdrawn

Anything else is a 409 naming the job's status and what it can do instead. Each change writes one event
whose data names the transition (`kind`), which the dashboard and webhooks read.
"""

from __future__ import annotations

import time

from sqlalchemy.orm import Session

from service.errors import Conflict
from service.ids import now
from service.jobs.dispatch import send_after_commit
from service.jobs.events import add_event, state_event
from service.jobs.lifecycle import move, queued_values
from service.jobs.schemas import TERMINAL_STATUSES
from service.jobs.service import get_job
from service.models import Job, Tenant

# A transition's compare-and-set can lose to a worker moving the job at the same moment; each loss
# means the status moved on (queued -> running -> paused), so a few rounds always settle it.
_ROUNDS = 5


def _conflict(job: Job, action: str, allowed: str, code: str) -> Conflict:
    state = f"has already {job.status}" if job.status in TERMINAL_STATUSES else f"is {job.status}"
    hint = {
        "paused": f"; resume it with POST /v1/fine_tuning/jobs/{job.id}/resume",
        "running": f"; pause it with POST /v1/fine_tuning/jobs/{job.id}/pause",
        "queued": "; it starts when a worker is free",
    }.get(job.status, "")
    return Conflict(
        f"job {job.id} {state}; only {allowed} job can be {action}{hint}",
        param="fine_tuning_job_id",
        code=code,
    )


def cancel_job(session: Session, *, tenant: Tenant, job_id: str) -> Job:
    job = get_job(session, tenant=tenant, job_id=job_id)
    for _ in range(_ROUNDS):
        if job.status in TERMINAL_STATUSES:
            raise _conflict(job, "cancelled", "a queued, running or paused", "job_not_cancellable")
        # A running job's trainer sees the status change at its next control poll and stops within a step.
        if move(
            session, job, expect=(job.status,), status="cancelled", finished_at=now(), pause_requested=False
        ):
            data = state_event("cancelled", requested="cancel")
            add_event(session, job.id, "Job cancelled by user", data=data)
            break
        session.refresh(job)
    session.refresh(job)
    return job


def pause_job(session: Session, *, tenant: Tenant, job_id: str) -> Job:
    """Queued: paused at once. Running: the trainer writes a resumable checkpoint at its next control
    poll, frees its worker, and the job becomes `paused` (it stays `running` until then)."""
    job = get_job(session, tenant=tenant, job_id=job_id)
    for _ in range(_ROUNDS):
        if job.status == "queued":
            if move(session, job, expect=("queued",), status="paused", pause_requested=False):
                add_event(session, job.id, "Job paused before it started", data=state_event("paused"))
                break
        elif job.status == "running":
            if job.pause_requested:
                break  # asked already: pausing is idempotent
            if move(session, job, expect=("running",), pause_requested=True):
                add_event(
                    session,
                    job.id,
                    "Pause requested: the trainer checkpoints and stops at its next step",
                    data=state_event("running", "job.pause_requested"),
                )
                break
        else:
            raise _conflict(job, "paused", "a queued or running", "job_not_pausable")
        session.refresh(job)
    session.refresh(job)
    return job


def resume_job(session: Session, *, tenant: Tenant, job_id: str) -> Job:
    """Paused: queued again, and a worker continues from the pause checkpoint exactly. A pause that
    was requested but not carried out yet is withdrawn instead."""
    job = get_job(session, tenant=tenant, job_id=job_id)
    for _ in range(_ROUNDS):
        if job.status == "paused":
            t = time.time()
            if move(session, job, expect=("paused",), **queued_values(t)):
                add_event(
                    session,
                    job.id,
                    "Job resumed; queued to continue from its latest checkpoint",
                    data=state_event("queued", "job.resumed"),
                )
                send_after_commit(session, job.id, t, queue=job.queue)
                break
        elif job.status in ("queued", "running") and job.pause_requested:
            if move(session, job, expect=(job.status,), pause_requested=False):
                add_event(
                    session,
                    job.id,
                    "Pause request withdrawn; the job carries on",
                    data=state_event(job.status, "job.pause_withdrawn"),
                )
                break
        else:
            raise _conflict(job, "resumed", "a paused", "job_not_resumable")
        session.refresh(job)
    session.refresh(job)
    return job
