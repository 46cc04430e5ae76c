"""The Celery app of an inference worker (`tunehouse worker --inference`): the API's app with only the
inference and estimate tasks on it, consuming only the inference queue, so training never delays trying
a model. It runs no reconciler: it owns no jobs."""

from __future__ import annotations

from typing import Any

from celery import Celery

from service.inference.task import INFER_TASK
from service.jobs.estimate_task import ESTIMATE_TASK
from service.queue import get_celery
from worker.estimate import serve_estimate
from worker.inference import serve_request

app: Celery = get_celery()


# acks_late off: a request redelivered after a crash would answer a client that has gone; at most once
@app.task(name=INFER_TASK, acks_late=False)  # type: ignore[untyped-decorator]
def infer(payload: dict[str, Any]) -> None:
    serve_request(payload)


# a job's pre-flight estimate (service/jobs/estimate.py): at most once, as a request
@app.task(name=ESTIMATE_TASK, acks_late=False)  # type: ignore[untyped-decorator]
def estimate(payload: dict[str, Any]) -> None:
    serve_estimate(payload)
