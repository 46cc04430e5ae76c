"""Rules for fine-tuning jobs: validate and store a spec, move status, list what the worker wrote."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.base_models.catalog import resolve_base_model
from service.base_models.fine_tuned import find_final_checkpoint
from service.config import Settings
from service.errors import BadRequest, Conflict, NotFound
from service.files.service import get_file
from service.files.validation import METHOD_FORMATS, FileFormat
from service.ids import new_id, now
from service.jobs.events import add_event
from service.jobs.graders import python_graders, score_models
from service.jobs.schemas import TERMINAL_STATUSES
from service.jobs.spec import (
    RUNNABLE_METHODS,
    JobCreate,
    Method,
    SupervisedHyperparameters,
    SupervisedMethod,
    resolve_hyperparameters,
    stored_method,
)
from service.models import Checkpoint, File, Job, JobEvent, JobMetric, Tenant
from service.pagination import check_limit, page
from service.queue import RUN_JOB_TASK, enqueue_after_commit


def _check_file(session: Session, *, tenant: Tenant, file_id: str, param: str, method_type: str) -> File:
    try:
        row = get_file(session, tenant=tenant, file_id=file_id, param=param)
    except NotFound as exc:
        raise BadRequest(f"{param}: no such file '{file_id}'", param=param, code="invalid_file") from exc
    accepted = METHOD_FORMATS[method_type]
    if FileFormat(row.format) not in accepted:
        names = ", ".join(sorted(f.value for f in accepted))
        raise BadRequest(
            f"{param}: file '{file_id}' has format '{row.format}', "
            f"but method '{method_type}' needs one of: {names}",
            param=param,
            code="invalid_file_format",
        )
    return row


def _check_rl(
    session: Session, *, tenant: Tenant, method: Method, spec: JobCreate, settings: Settings
) -> None:
    grader = method.grader
    if grader is None:
        return
    param = f"method.{method.type}.grader"
    if spec.validation_file is not None:
        raise BadRequest(
            f"validation_file is not supported for method '{method.type}' yet",
            param="validation_file",
            code="not_implemented",
        )
    if python_graders(grader) and not settings.allow_python_grader:
        raise BadRequest(
            "python graders are disabled on this deployment (the operator enables them with "
            "TUNEHOUSE_ALLOW_PYTHON_GRADER=1)",
            param=f"{param}.type",
            code="python_grader_disabled",
        )
    for name in score_models(grader):
        if find_final_checkpoint(session, tenant_id=tenant.id, name=name, reward_model=True) is None:
            raise BadRequest(
                f"score_model grader: '{name}' is not a reward model of this organization "
                "(train one with method 'reward_model' and use its fine_tuned_model)",
                param=f"{param}.model",
                code="model_not_available",
            )


def _method_of(spec: JobCreate) -> Method:
    if spec.method is not None and spec.hyperparameters is not None:
        raise BadRequest(
            "give hyperparameters inside 'method', not at the top level as well",
            param="hyperparameters",
            code="invalid_value",
        )
    if spec.method is not None:
        return spec.method
    legacy = spec.hyperparameters.model_dump() if spec.hyperparameters else {}
    return Method(
        type="supervised", supervised=SupervisedMethod(hyperparameters=SupervisedHyperparameters(**legacy))
    )


def create_job(session: Session, *, tenant: Tenant, spec: JobCreate, settings: Settings) -> Job:
    is_fine_tuned = spec.model.startswith("ft:") and (
        find_final_checkpoint(session, tenant_id=tenant.id, name=spec.model) is not None
    )
    if not is_fine_tuned and resolve_base_model(settings, spec.model) is None:
        raise BadRequest(
            f"model '{spec.model}' is not available for fine-tuning here; see GET /v1/models",
            param="model",
            code="model_not_available",
        )
    if spec.integrations:
        raise BadRequest("integrations are not supported", param="integrations", code="not_implemented")
    method = _method_of(spec)
    if method.type not in RUNNABLE_METHODS:
        raise BadRequest(
            f"method '{method.type}' is not implemented yet; available: {', '.join(RUNNABLE_METHODS)}",
            param="method.type",
            code="not_implemented",
        )
    _check_rl(session, tenant=tenant, method=method, spec=spec, settings=settings)
    training = _check_file(
        session, tenant=tenant, file_id=spec.training_file, param="training_file", method_type=method.type
    )
    if spec.validation_file is not None:
        _check_file(
            session,
            tenant=tenant,
            file_id=spec.validation_file,
            param="validation_file",
            method_type=method.type,
        )

    resolve_hyperparameters(method, n_examples=training.line_count)
    job = Job(
        id=new_id("ftjob"),
        tenant_id=tenant.id,
        model=spec.model,
        training_file=spec.training_file,
        validation_file=spec.validation_file,
        method=stored_method(method),
        suffix=spec.suffix,
        seed=spec.seed if spec.seed is not None else secrets.randbelow(2**31),
        user_metadata=spec.metadata,
        status="validating_files",
    )
    session.add(job)
    session.flush()
    add_event(session, job.id, f"Validating training file: {spec.training_file}")
    # files are validated line by line at upload, so the job can move on at once
    job.status = "queued"
    add_event(session, job.id, "Files validated, moving job to queued state")
    enqueue_after_commit(session, RUN_JOB_TASK, [job.id])
    return job


def get_job(session: Session, *, tenant: Tenant, job_id: str) -> Job:
    job = session.scalar(select(Job).where(Job.id == job_id, Job.tenant_id == tenant.id))
    if job is None:
        raise NotFound(f"No such fine-tuning job: {job_id}", param="fine_tuning_job_id", code="job_not_found")
    return job


def list_jobs(
    session: Session, *, tenant: Tenant, after: str | None, limit: int, metadata: dict[str, str]
) -> tuple[Sequence[Job], bool]:
    stmt = select(Job).where(Job.tenant_id == tenant.id)
    if metadata:
        # JSON containment differs between SQLite and PostgreSQL; filter in Python over a bounded scan
        rows: list[Job]
        rows, _ = page(session, stmt, Job.id, after=after, limit=10_000)
        matching = [j for j in rows if all((j.user_metadata or {}).get(k) == v for k, v in metadata.items())]
        check_limit(limit)
        return matching[:limit], len(matching) > limit
    return page(session, stmt, Job.id, after=after, limit=limit)


def cancel_job(session: Session, *, tenant: Tenant, job_id: str) -> Job:
    job = get_job(session, tenant=tenant, job_id=job_id)
    if job.status in TERMINAL_STATUSES:
        raise Conflict(
            f"job {job_id} has already {job.status}; it cannot be cancelled",
            param="fine_tuning_job_id",
            code="job_not_cancellable",
        )
    # A running job's worker sees the status change at its next control poll and stops within a step.
    job.status = "cancelled"
    job.finished_at = now()
    add_event(session, job.id, "Job cancelled by user", data={"requested": "cancel"})
    return job


def not_implemented_control(action: str) -> BadRequest:
    return BadRequest(
        f"{action} is not implemented yet; a job can be cancelled, or left to finish",
        param="fine_tuning_job_id",
        code="not_implemented",
    )


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
