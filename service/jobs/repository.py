"""The jobs table's queries: every read of a job, and every write to it that is not a change of its status.

A status change is a compare-and-set function of ``service/jobs/lifecycle.py``; the order in which queued
jobs are claimed is ``service/jobs/fairness.py`` (a rule, written as SQL); a fine-tuned model's lookup by
its final checkpoint is ``service/base_models/fine_tuned.py`` (a checkpoint query). Everything else that
touches ``Job`` (the API's reads, the worker's progress, the outbox's ``dispatched_at``) is a function
here, so one module shows how the table is used and which indexes that needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from sqlalchemy import Row, Select, bindparam, func, inspect, select, update
from sqlalchemy.orm import Session

from service.jobs.fairness import position_column
from service.jobs.schemas import TERMINAL_STATUSES
from service.models import Job, JobMetric

# -- one job ------------------------------------------------------------------------------------------------


@cache
def _tenant_job() -> Select[Job]:
    # built once, its values bound at execution: building it per call (the comparisons' bind parameters
    # and the statement's cache key) was ~3% of the CPU of a job's read under load
    return select(Job).where(Job.id == bindparam("job_id"), Job.tenant_id == bindparam("tenant_id"))


def tenant_job(session: Session, *, tenant_id: str, job_id: str) -> Job | None:
    """The tenant's job ``job_id``; None if there is none (another tenant's job included)."""
    job: Job | None = session.scalar(_tenant_job(), {"job_id": job_id, "tenant_id": tenant_id})
    return job


def job_read_query() -> Select[Any]:
    """A job's read, the call a polling dashboard makes most, as one Core statement: the job's columns,
    each labelled with its `Job` attribute's name (so a row reads like a `Job` for `JobObject.of`), and
    its queue position as `queue_position`. Its rows are plain tuples: mapping them to `Job` objects in
    an ORM session was a seventh of the read's CPU (git log -p docs/benchmarks.md). Values bound at
    execution: `job_id`, `tenant_id`. Built once, into the route's `CompiledRead` (service/jobs/routes.py)."""
    columns = [attr.columns[0].label(attr.key) for attr in inspect(Job).column_attrs]
    return select(*columns, position_column().label("queue_position")).where(
        Job.id == bindparam("job_id"), Job.tenant_id == bindparam("tenant_id")
    )


def tenant_jobs(tenant_id: str) -> Select[Job]:
    """The tenant's jobs, for a page (``service.pagination.page`` orders and bounds it)."""
    return select(Job).where(Job.tenant_id == tenant_id)


def job(session: Session, job_id: str) -> Job | None:
    """The job, whoever's (the worker's read: it runs jobs by id)."""
    return session.get(Job, job_id)


def status_of(session: Session, job_id: str) -> str | None:
    status: str | None = session.scalar(select(Job.status).where(Job.id == job_id))
    return status


def queue_of(session: Session, job_id: str) -> str | None:
    queue: str | None = session.scalar(select(Job.queue).where(Job.id == job_id))
    return queue


def restarts_of(session: Session, job_id: str) -> int:
    return int(session.scalar(select(Job.restarts).where(Job.id == job_id)) or 0)


def attempt_and_resources(session: Session, job_id: str) -> Row[int, dict[str, Any] | None]:
    """The job's claim count and its requested ``resources`` (``service/jobs/resources.py``)."""
    return session.execute(select(Job.attempts, Job.resources).where(Job.id == job_id)).one()


def method_of(session: Session, job_id: str) -> dict[str, Any]:
    """The job's stored method spec (``service.jobs.spec.load_method`` reads it)."""
    method: dict[str, Any] = session.execute(select(Job.method).where(Job.id == job_id)).scalar_one()
    return method


def control_state(session: Session, job_id: str) -> Row[str, str | None, bool]:
    """What a running job's trainer polls: status, lease holder and whether a pause was requested."""
    return session.execute(
        select(Job.status, Job.worker_id, Job.pause_requested).where(Job.id == job_id)
    ).one()


def liveness(session: Session, job_id: str) -> Row[str, str | None, float | None] | None:
    """Status, lease holder and last heartbeat: what a live stream needs to tell a settled job."""
    return session.execute(
        select(Job.status, Job.worker_id, Job.heartbeat_at).where(Job.id == job_id)
    ).one_or_none()


# -- the worker's progress ----------------------------------------------------------------------------------
def set_total_steps(session: Session, job_id: str, total_steps: int) -> None:
    session.execute(update(Job).where(Job.id == job_id).values(total_steps=total_steps))


def record_progress(session: Session, job_id: str, **progress: Any) -> None:
    """``current_step``, ``estimated_finish`` and (when known) ``trained_tokens`` of a running job."""
    session.execute(update(Job).where(Job.id == job_id).values(**progress))


# -- across jobs --------------------------------------------------------------------------------------------
def queued_on_gpu_queues(session: Session, base_queue: str) -> Sequence[Job]:
    """The queued multi-GPU jobs of a worker pool (their queues are ``<base_queue>.gpus<N>``)."""
    return session.scalars(
        select(Job).where(Job.status == "queued", Job.queue.startswith(f"{base_queue}.gpus", autoescape=True))
    ).all()


def unfinished_models_and_methods(session: Session, tenant_id: str) -> Sequence[Row[str, Any]]:
    """(model, stored method) of each of the tenant's jobs that has not ended."""
    return session.execute(
        select(Job.model, Job.method).where(Job.tenant_id == tenant_id, Job.status.not_in(TERMINAL_STATUSES))
    ).all()


def latest_metrics_of_succeeded(
    session: Session, *, model: str, method: str, jobs: int, rows: int
) -> Sequence[Row[str, dict[str, Any]]]:
    """(job id, values) of the newest ``rows`` metric rows of the ``jobs`` latest succeeded jobs on
    ``model`` with ``method`` (any tenant's: the fleet's measured throughput)."""
    latest = (
        select(Job.id)
        .where(Job.model == model, Job.method["type"].as_string() == method, Job.status == "succeeded")
        .order_by(Job.finished_at.desc())
        .limit(jobs)
        .scalar_subquery()
    )
    return session.execute(
        select(JobMetric.job_id, JobMetric.values)
        .where(JobMetric.job_id.in_(latest))
        .order_by(JobMetric.created_at.desc())
        .limit(rows)
    ).all()


def count_by_status(session: Session) -> dict[str, int]:
    return {
        status: count
        for status, count in session.execute(select(Job.status, func.count()).group_by(Job.status))
    }


# -- the outbox (service/jobs/dispatch.py) ------------------------------------------------------------------
def due_for_dispatch(
    session: Session, *, sent_before: float
) -> Sequence[Row[str, float | None, float | None, str]]:
    """(id, queued_at, dispatched_at, queue) of the queued jobs never sent or last sent before
    ``sent_before``, oldest first."""
    return session.execute(
        select(Job.id, Job.queued_at, Job.dispatched_at, Job.queue)
        .where(Job.status == "queued")
        .where(Job.dispatched_at.is_(None) | (Job.dispatched_at <= sent_before))
        .order_by(Job.queued_at)
    ).all()


def swap_dispatched_at(
    session: Session, job_id: str, *, expect: float | None, to: float | None, queued_only: bool = True
) -> bool:
    """Set ``dispatched_at`` from ``expect`` to ``to`` (a compare-and-set: one sender per job and pass);
    whether this call won. ``queued_only``: only while the job is still queued."""
    same = Job.dispatched_at.is_(None) if expect is None else Job.dispatched_at == expect
    where = [Job.id == job_id, same] + ([Job.status == "queued"] if queued_only else [])
    result = session.execute(
        update(Job).where(*where).values(dispatched_at=to).execution_options(synchronize_session=False)
    )
    return getattr(result, "rowcount", 0) == 1
