"""The Celery app as workers see it: the API's app (service.queue) with the worker's tasks on it.

Run with `tunehouse worker` (or `celery -A worker.celery_app worker --pool solo`). The solo pool runs
one job at a time; the job itself runs in a fresh child process (worker/supervisor.py). Each worker
runs the reconciler (worker/reaper.py) and the webhook delivery loop (worker/webhooks.py). On
SIGTERM/SIGINT (warm shutdown) the worker stops taking messages and hands its running job back
(checkpoint + requeue, worker/supervisor.py) before it exits.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import Celery
from celery.signals import worker_ready, worker_shutdown, worker_shutting_down

from service.config import get_settings
from service.graders.service import require_python_grader_sandbox
from service.queue import get_celery
from worker.reaper import advertise_worker, retire_worker, start_reaper
from worker.supervisor import default_worker_id, keep_a_spare_trainer, request_shutdown, stop_spare_trainer
from worker.webhooks import start_delivery_loop

# A training worker runs RL jobs' python graders: enabled, they need the sandbox (or the operator's
# explicit unsafe choice); without it the worker does not start (service/graders/service.py)
require_python_grader_sandbox(get_settings())

app: Celery = get_celery()

import worker.tasks  # noqa: E402,F401  (registers the tasks on `app`)

log = logging.getLogger("tunehouse.worker")
_reaper_stop = threading.Event()


@worker_ready.connect  # type: ignore[untyped-decorator]
def _start_reaper(**_: Any) -> None:
    try:
        advertise_worker(default_worker_id())  # at once: a job waiting for this worker's GPUs sees it
    except Exception:  # the database is down: the reconciler's first pass advertises it
        log.warning("could not advertise this worker's GPUs yet", exc_info=True)
    start_reaper(_reaper_stop, worker_id=default_worker_id())
    start_delivery_loop(_reaper_stop, worker_id=default_worker_id())
    if get_settings().spare_trainer:
        keep_a_spare_trainer()


@worker_shutting_down.connect  # type: ignore[untyped-decorator]
def _hand_back_running_job(**_: Any) -> None:
    # runs inside the signal handler: only set a flag; the supervisor's loop does the rest
    request_shutdown()


@worker_shutdown.connect  # type: ignore[untyped-decorator]
def _stop_reaper(**_: Any) -> None:
    _reaper_stop.set()
    stop_spare_trainer()
    try:
        retire_worker(default_worker_id())
    except Exception:  # its row then goes stale within a lease timeout
        log.warning("could not remove this worker's row", exc_info=True)
