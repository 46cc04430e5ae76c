"""Getting a queued job to a worker: the job row is the outbox, a reconciler guarantees delivery.

A job becomes `queued` in the DB first; its run message is sent after that commit (service/queue.py).
The send can fail (broker down: the API still answers, the job is stored) and a broker can lose a sent
message (Redis restarted without persistence). So every worker runs `reconcile` every few seconds
(worker/reaper.py; `tunehouse up` runs a worker too): a job still `queued` `dispatch_timeout` after its
last send is sent again, and one whose send failed is sent at the next pass. Two messages for one job
are harmless: the DB lease (service/jobs/lifecycle.py) lets exactly one claim win; the other finds the job
taken and returns.

Every way back to the queue goes through `service.jobs.lifecycle.requeue` (a stale lease, a dead
trainer, a worker handing its job back on SIGTERM, a resumed pause); this module writes only when a
queued job's message was sent (`dispatched_at`), never its status.

service.queue (Celery) is imported where a message is sent, not at the top: every job's trainer
process imports this module (worker/recovery.py) and sends nothing unless it hands its job back, and
importing Celery is a measurable share of each trainer's start (`python -X importtime` shows it).
"""

from __future__ import annotations

import logging
import time

from sqlalchemy.orm import Session

from service.db import session_scope
from service.jobs import repository

log = logging.getLogger("tunehouse.dispatch")

# Re-sends of a job that stays queued back off: timeout, then 2x, 4x, ... the time it has waited, up to
# this. A job merely waiting behind long jobs thus costs a few duplicate messages per hour (each one a
# single failed claim), not one per reconciler pass.
MAX_RESEND_INTERVAL_SECONDS = 600.0


def _mark_unsent(job_id: str, sent_at: float) -> None:
    """The send after commit failed: clear `dispatched_at` so the next reconciler pass sends it."""
    with session_scope() as session:
        repository.swap_dispatched_at(session, job_id, expect=sent_at, to=None)


def send_after_commit(session: Session, job_id: str, sent_at: float, *, queue: str) -> None:
    """Send the job's run message to its `queue` once `session` commits; on failure mark it unsent for
    the reconciler."""
    from service.queue import RUN_JOB_TASK, enqueue_after_commit  # not at the top: see the module docstring

    enqueue_after_commit(
        session, RUN_JOB_TASK, [job_id], queue=queue, on_failure=lambda: _mark_unsent(job_id, sent_at)
    )


def _resend_due(t: float, queued_at: float | None, dispatched_at: float | None, timeout: float) -> bool:
    if dispatched_at is None:
        return True
    waited = dispatched_at - (queued_at if queued_at is not None else dispatched_at)
    return t - dispatched_at >= min(max(timeout, waited), max(timeout, MAX_RESEND_INTERVAL_SECONDS))


def reconcile(*, dispatch_timeout: float) -> list[str]:
    """Send again every queued job not claimed in time; returns the ids sent. Safe to run anywhere, any
    number of times at once: a compare-and-set on `dispatched_at` picks one sender per job and pass."""
    t = time.time()
    with session_scope() as session:
        rows = repository.due_for_dispatch(session, sent_before=t - dispatch_timeout)
    sent: list[str] = []
    for job_id, queued_at, dispatched_at, queue in rows:
        if not _resend_due(t, queued_at, dispatched_at, dispatch_timeout):
            continue
        with session_scope() as session:
            if not repository.swap_dispatched_at(session, job_id, expect=dispatched_at, to=t):
                continue  # another reconciler sent it, or a worker claimed it meanwhile
        from service.queue import RUN_JOB_TASK, send_task  # not at the top: see the module docstring

        if not send_task(RUN_JOB_TASK, [job_id], queue=queue):
            with session_scope() as session:
                repository.swap_dispatched_at(session, job_id, expect=t, to=dispatched_at, queued_only=False)
            break  # the broker is down: the other jobs wait for the next pass, not for N timeouts here
        sent.append(job_id)
    return sent
