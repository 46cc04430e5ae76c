"""Celery tasks: thin wrappers over plain functions that tests can run without Celery."""

from __future__ import annotations

from service.queue import RUN_JOB_TASK, get_celery
from worker.supervisor import supervise_job

app = get_celery()


@app.task(name=RUN_JOB_TASK)  # type: ignore[untyped-decorator]
def run_job(job_id: str) -> None:
    supervise_job(job_id)
