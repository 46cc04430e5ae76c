"""The Celery app as the API sees it: it sends tasks by name and never imports the worker.

Commit, then enqueue: `enqueue_after_commit` parks a task on the session; it is sent only when that
session commits and dropped when it rolls back, so a worker never sees a job the DB does not have.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from celery import Celery
from sqlalchemy import event
from sqlalchemy.orm import Session

from service.config import get_settings

RUN_JOB_TASK = "tunehouse.run_job"
_PENDING = "tunehouse_pending_tasks"


@lru_cache
def get_celery() -> Celery:
    settings = get_settings()
    if settings.is_embedded_broker:
        settings.broker_folder.mkdir(parents=True, exist_ok=True)
    app = Celery("tunehouse", broker=settings.broker_url)
    app.conf.update(
        broker_transport_options=settings.celery_transport_options(),
        broker_connection_retry_on_startup=True,
        task_ignore_result=True,
        # Ack after the task ends so a worker that dies mid-job gets the message redelivered; the DB
        # lease makes the second delivery harmless (worker/lease.py).
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue="tunehouse",
    )
    return app


def send_task(name: str, args: list[Any]) -> None:
    get_celery().send_task(name, args=args)


def enqueue_after_commit(session: Session, name: str, args: list[Any]) -> None:
    session.info.setdefault(_PENDING, []).append((name, args))


@event.listens_for(Session, "after_commit")
def _send_pending(session: Session) -> None:
    for name, args in session.info.pop(_PENDING, []):
        send_task(name, args)


@event.listens_for(Session, "after_rollback")
def _drop_pending(session: Session) -> None:
    session.info.pop(_PENDING, None)
