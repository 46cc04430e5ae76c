"""Reading fine-tuning jobs and what their workers wrote: a job, the list, events, checkpoints, metrics.
(Creating one: service/jobs/creation.py; cancel, pause and resume: service/jobs/transitions.py.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.errors import BadRequest, NotFound
from service.jobs import repository
from service.models import Checkpoint, Job, JobEvent, JobMetric, Tenant
from service.pagination import check_limit, page


def no_such_job(job_id: str) -> NotFound:
    return NotFound(f"No such fine-tuning job: {job_id}", param="fine_tuning_job_id", code="job_not_found")


def get_job(session: Session, *, tenant: Tenant, job_id: str) -> Job:
    job = repository.tenant_job(session, tenant_id=tenant.id, job_id=job_id)
    if job is None:
        raise no_such_job(job_id)
    return job


def list_jobs(
    session: Session, *, tenant: Tenant, after: str | None, limit: int, metadata: dict[str, str]
) -> tuple[Sequence[Job], bool]:
    stmt = repository.tenant_jobs(tenant.id)
    if metadata:
        # JSON containment differs between SQLite and PostgreSQL; filter in Python over a bounded scan
        rows: list[Job]
        rows, _ = page(session, stmt, Job.id, after=after, limit=10_000)
        matching = [j for j in rows if all((j.user_metadata or {}).get(k) == v for k, v in metadata.items())]
        check_limit(limit)
        return matching[:limit], len(matching) > limit
    return page(session, stmt, Job.id, after=after, limit=limit)


def list_events(
    session: Session, *, job: Job, after: str | None, limit: int
) -> tuple[Sequence[JobEvent], bool]:
    stmt = select(JobEvent).where(JobEvent.job_id == job.id)
    cursor: int | None = None
    if after is not None:
        cursor = session.scalar(select(JobEvent.seq).where(JobEvent.id == after, JobEvent.job_id == job.id))
        if cursor is None:
            raise BadRequest(f"after: no such event '{after}' in job {job.id}", param="after")
    return page(session, stmt, JobEvent.seq, after=cursor, limit=limit)


def list_checkpoints(
    session: Session, *, job: Job, after: str | None, limit: int
) -> tuple[Sequence[Checkpoint], bool]:
    stmt = select(Checkpoint).where(Checkpoint.job_id == job.id)
    return page(session, stmt, Checkpoint.id, after=after, limit=limit)


def get_checkpoint(session: Session, *, job: Job, checkpoint_id: str) -> Checkpoint:
    row = session.scalar(
        select(Checkpoint).where(Checkpoint.id == checkpoint_id, Checkpoint.job_id == job.id)
    )
    if row is None:
        raise NotFound(
            f"No such checkpoint: {checkpoint_id}", param="checkpoint_id", code="checkpoint_not_found"
        )
    if row.deleted_at is not None:
        raise NotFound(
            f"checkpoint {checkpoint_id} is the model '{row.fine_tuned_model_checkpoint}', which was deleted",
            param="checkpoint_id",
            code="model_deleted",
        )
    return row


def list_metrics(
    session: Session, *, job: Job, after: int | None, limit: int
) -> tuple[Sequence[JobMetric], bool]:
    stmt = select(JobMetric).where(JobMetric.job_id == job.id)
    return page(session, stmt, JobMetric.step, after=after, limit=limit, order="asc")


def metadata_filter(query: dict[str, Any]) -> dict[str, str]:
    """`?metadata[key]=value` query parameters, as OpenAI's list endpoint takes them."""
    out: dict[str, str] = {}
    for name, value in query.items():
        if name.startswith("metadata[") and name.endswith("]"):
            out[name[9:-1]] = str(value)
    return out
