"""The Celery app as the API sees it: it sends tasks by name and never imports the worker.

Commit, then enqueue: `enqueue_after_commit` parks a task on the session; it is sent only when that
session commits and dropped when it rolls back, so a worker never sees a job the DB does not have.
A send is bounded (a few short retries) and never raises: with the broker down the committed row stays
the record and the reconciler (service/jobs/dispatch.py) sends it later, so a client gets its answer
instead of a 500 for a job that was in fact stored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from celery import Celery
from sqlalchemy import event
from sqlalchemy.orm import Session

from service.config import Settings, get_settings

log = logging.getLogger("tunehouse.queue")

RUN_JOB_TASK = "tunehouse.run_job"
_PENDING = "tunehouse_pending_tasks"
# Publishing retries: 3 tries within ~0.3 s, then give up; the reconciler retries later, so a request
# never waits long on a broker that is down (Celery's default policy takes ~0.65 s and then raises).
# A broker that hangs instead costs each try settings.broker_socket_timeout_seconds (~2.1 s in all).
SEND_RETRY_POLICY = {"max_retries": 2, "interval_start": 0.0, "interval_step": 0.1, "interval_max": 0.2}
# seconds to open a broker connection before a send counts as failed (an unreachable host, not a
# refused port, would otherwise block for the OS' TCP timeout, minutes)
BROKER_CONNECT_TIMEOUT = 2.0

OnFailure = Callable[[], None]


@lru_cache
def get_celery() -> Celery:
    return make_celery(get_settings())


def make_celery(settings: Settings) -> Celery:
    if settings.is_embedded_broker:
        settings.broker_folder.mkdir(parents=True, exist_ok=True)
    app = Celery("tunehouse", broker=settings.broker_url)
    app.conf.update(
        broker_transport_options=settings.celery_transport_options(),
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=BROKER_CONNECT_TIMEOUT,
        task_ignore_result=True,
        # Ack after the task ends so a worker that dies mid-job gets the message redelivered; the DB
        # lease makes the second delivery harmless (service/jobs/lifecycle.py).
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=settings.job_queue,
        # Nothing here uses Celery's remote control (inspect, revoke, broadcast). On the embedded
        # broker it also costs a crash: every worker binds its control queue into one shared file in
        # the broker folder at start, and kombu's filesystem transport creates that file before it
        # locks it, so a second worker starting at the same moment (`tunehouse up` starts the
        # training and the inference worker together) can read it empty and die of a JSONDecodeError.
        worker_enable_remote_control=not settings.is_embedded_broker,
    )
    return app


def send_task(name: str, args: list[Any], *, queue: str | None = None, expires: float | None = None) -> bool:
    """Publish a task (to `queue`, default the app's; dropped unconsumed after `expires`
    seconds); False (logged) when the broker cannot be reached within the retry policy."""
    try:
        get_celery().send_task(
            name, args=args, queue=queue, expires=expires, retry=True, retry_policy=SEND_RETRY_POLICY
        )
    except Exception:  # any broker failure: the caller's DB row is the record, it is re-sent later
        log.warning("could not send %s%s to the broker; it will be re-sent", name, args, exc_info=True)
        return False
    return True


def enqueue_after_commit(
    session: Session,
    name: str,
    args: list[Any],
    *,
    queue: str | None = None,
    on_failure: OnFailure | None = None,
) -> None:
    """Send `name(*args)` to `queue` once `session` commits; `on_failure` runs if that send fails."""
    session.info.setdefault(_PENDING, []).append((name, args, queue, on_failure))


@event.listens_for(Session, "after_commit")
def _send_pending(session: Session) -> None:
    for name, args, queue, on_failure in session.info.pop(_PENDING, []):
        if not send_task(name, args, queue=queue) and on_failure is not None:
            try:
                on_failure()
            except Exception:  # e.g. the DB went too: the reconciler's timeout still catches the job
                log.warning("could not record the failed send of %s%s", name, args, exc_info=True)


@event.listens_for(Session, "after_rollback")
def _drop_pending(session: Session) -> None:
    session.info.pop(_PENDING, None)
