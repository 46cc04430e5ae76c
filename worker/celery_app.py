"""The Celery app as workers see it: the API's app (service.queue) with the worker's tasks on it.

Run with `tunehouse worker` (or `celery -A worker.celery_app worker --pool solo`). The solo pool runs
one job at a time; the job itself runs in a fresh child process (worker/supervisor.py).
"""

from __future__ import annotations

import threading
from typing import Any

from celery import Celery
from celery.signals import worker_ready, worker_shutdown

from service.queue import get_celery
from worker.reaper import start_reaper

app: Celery = get_celery()

import worker.tasks  # noqa: E402,F401  (registers the tasks on `app`)

_reaper_stop = threading.Event()


@worker_ready.connect  # type: ignore[untyped-decorator]
def _start_reaper(**_: Any) -> None:
    start_reaper(_reaper_stop)


@worker_shutdown.connect  # type: ignore[untyped-decorator]
def _stop_reaper(**_: Any) -> None:
    _reaper_stop.set()
