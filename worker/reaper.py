"""Finds running jobs whose worker stopped heartbeating and sends them to the queue again.

The broker alone would redeliver only after its visibility timeout (hours, on Redis); the reaper makes
a dead worker's job resume from its latest checkpoint within about one lease timeout. Every worker
runs one; duplicates are harmless because only one claim of a stale lease can succeed.
"""

from __future__ import annotations

import logging
import threading

from service.config import get_settings
from service.db import session_scope
from service.jobs.events import add_event
from service.queue import RUN_JOB_TASK, send_task
from worker import lease

log = logging.getLogger("tunehouse.worker")


def requeue_stale_jobs() -> list[str]:
    settings = get_settings()
    with session_scope() as session:
        stale = lease.stale_running_jobs(session, lease_timeout=settings.lease_timeout_seconds)
        for job_id in stale:
            add_event(session, job_id, "Worker stopped responding; job sent back to the queue", level="warn")
    for job_id in stale:
        send_task(RUN_JOB_TASK, [job_id])
    return stale


def start_reaper(stop: threading.Event) -> threading.Thread:
    interval = max(1.0, get_settings().lease_timeout_seconds / 2)

    def loop() -> None:
        while not stop.wait(interval):
            try:
                requeued = requeue_stale_jobs()
                if requeued:
                    log.warning("requeued stale jobs: %s", ", ".join(requeued))
            except Exception:  # the reaper must outlive a DB blip
                log.exception("reaper pass failed")

    thread = threading.Thread(target=loop, name="tunehouse-reaper", daemon=True)
    thread.start()
    return thread
