"""Each worker's reconciler: nothing sits in `queued` or behind a dead worker's lease forever.

Every `reconcile_seconds` it
- requeues running jobs whose worker stopped heartbeating (the broker alone would redeliver only after
  its visibility timeout, hours on Redis), as a charged restart (worker/recovery.py): they resume from
  their latest checkpoint within about one lease timeout;
- re-sends queued jobs that no worker claimed in time: their message was never sent (broker down at
  creation) or was lost (broker restart) (service/jobs/dispatch.py);
- removes the blobs of deleted models that an unfinished job held until now
  (service/models_api/lifecycle.py);
- advertises this worker's GPUs, and notes on each queued job that no live worker can hold that it
  waits for one (service/jobs/capacity.py).
Every worker runs one; running several is harmless: each transition is a compare-and-set on the row.
"""

from __future__ import annotations

import logging
import threading
import time

from service.config import get_settings
from service.db import session_scope
from service.jobs import lifecycle
from service.jobs.capacity import advertise, note_unfit_jobs, retire
from service.jobs.dispatch import reconcile
from service.models import Job
from service.models_api.lifecycle import sweep_deleted_models
from service.storage import get_blob_store
from worker.devices import worker_stats
from worker.launch import worker_device, worker_gpus
from worker.outage import is_outage
from worker.recovery import restart_or_fail

log = logging.getLogger("tunehouse.worker")


def requeue_stale_jobs() -> list[str]:
    settings = get_settings()
    with session_scope() as session:
        stale = lifecycle.stale_running_jobs(session, lease_timeout=settings.lease_timeout_seconds)
    moved = []
    cause = f"its worker stopped responding (no heartbeat for {settings.lease_timeout_seconds:.0f}s)"
    for job_id in stale:
        cutoff = time.time() - settings.lease_timeout_seconds
        still_stale = (Job.status == "running") & (Job.heartbeat_at.is_(None) | (Job.heartbeat_at < cutoff))
        with session_scope() as session:
            status = restart_or_fail(
                session,
                job_id=job_id,
                expect=still_stale,
                cause=cause,
                max_restarts=settings.max_restarts,
            )
        if status is not None:
            moved.append(job_id)
    return moved


def advertise_worker(worker_id: str) -> None:
    settings = get_settings()
    with session_scope() as session:
        advertise(
            session,
            worker_id=worker_id,
            queue=settings.job_queue,
            gpus=worker_gpus(settings),
            device=worker_device(),
            stats=worker_stats(),
        )


def retire_worker(worker_id: str) -> None:
    with session_scope() as session:
        retire(session, worker_id=worker_id)


def reconcile_once(worker_id: str | None = None) -> tuple[list[str], list[str]]:
    """One pass: (stale jobs requeued, queued jobs re-sent); deleted models' blobs swept on the way,
    and `worker_id`'s capacity advertised (None: a pass run by hand, for no worker)."""
    settings = get_settings()
    stale, resent = requeue_stale_jobs(), reconcile(dispatch_timeout=settings.dispatch_timeout_seconds)
    with session_scope() as session:
        sweep_deleted_models(session, blobs=get_blob_store(), models_dir=settings.models_dir)
    if worker_id is not None:
        advertise_worker(worker_id)
    with session_scope() as session:
        note_unfit_jobs(session, base_queue=settings.job_queue, within=settings.lease_timeout_seconds)
    return stale, resent


def start_reaper(stop: threading.Event, *, worker_id: str) -> threading.Thread:
    interval = max(0.1, get_settings().reconcile_seconds)

    def loop() -> None:
        while not stop.wait(interval):
            try:
                stale, resent = reconcile_once(worker_id)
                if stale:
                    log.warning("requeued jobs of unresponsive workers: %s", ", ".join(stale))
                if resent:
                    log.warning("re-sent queued jobs no worker had claimed: %s", ", ".join(resent))
            except Exception as exc:  # the reconciler must outlive anything a pass meets
                if is_outage(exc):  # nothing to reconcile against; the first pass after it does it
                    log.warning("reconciler pass skipped: database unavailable")
                else:
                    log.exception("reconciler pass failed")

    thread = threading.Thread(target=loop, name="tunehouse-reconciler", daemon=True)
    thread.start()
    return thread
