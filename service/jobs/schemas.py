"""Fine-tuning API objects in OpenAI's shapes, plus documented extensions (progress, metrics)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, Field

from service.db_reads import ReadRow
from service.jobs.resources import global_batch_size, job_resources
from service.models import Checkpoint, Job, JobEvent, JobMetric

JobStatus = Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled", "paused"]
JOB_STATUSES: tuple[str, ...] = get_args(JobStatus)
TERMINAL_STATUSES = ("succeeded", "failed", "cancelled")

# OpenAI's limits for `metadata`: at most 16 pairs, keys of at most 64 characters, values of at most 512
METADATA_MAX_PAIRS, METADATA_MAX_KEY, METADATA_MAX_VALUE = 16, 64, 512
Metadata = Annotated[
    dict[
        Annotated[str, Field(max_length=METADATA_MAX_KEY)],
        Annotated[str, Field(max_length=METADATA_MAX_VALUE)],
    ],
    Field(max_length=METADATA_MAX_PAIRS),
]


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None
    # extension: "user" when the data or spec was at fault, "system" when we were
    fault: Literal["user", "system"] = "system"


# a mapped job, or a row of its columns under the same names (service.jobs.repository.job_read_query)
JobFields = Job | ReadRow


class JobObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None
    fine_tuned_model: str | None
    finished_at: int | None
    hyperparameters: dict[str, Any]
    model: str
    organization_id: str
    result_files: list[str]
    seed: int
    status: JobStatus
    trained_tokens: int | None
    training_file: str
    validation_file: str | None
    estimated_finish: int | None = None
    integrations: list[dict[str, Any]] = []
    metadata: dict[str, str] | None
    method: dict[str, Any]
    user_provided_suffix: str | None
    # extensions
    started_at: int | None
    current_step: int
    total_steps: int | None
    # 1-based place in the fair start order (service/jobs/fairness.py) while queued, else null
    queue_position: int | None = None
    # {"nodes", "gpus_per_node", "gpus", "strategy", "global_batch_size"}: what the job trains on
    # (service/jobs/resources.py)
    resources: dict[str, Any] = {}

    @classmethod
    def of(cls, job: JobFields, *, queue_position: int | None = None) -> JobObject:
        method_type = job.method["type"]
        hp = dict(job.method.get(method_type, {}).get("hyperparameters", {}))
        legacy = {k: hp[k] for k in ("n_epochs", "batch_size", "learning_rate_multiplier") if k in hp}
        return cls(
            id=job.id,
            created_at=job.created_at,
            error=JobError(**job.error) if job.error else None,
            fine_tuned_model=job.fine_tuned_model,
            finished_at=job.finished_at,
            hyperparameters=legacy,
            model=job.model,
            organization_id=job.tenant_id,
            result_files=list(job.result_files or []),
            seed=job.seed,
            status=job.status,  # type: ignore[arg-type]
            trained_tokens=job.trained_tokens,
            training_file=job.training_file,
            validation_file=job.validation_file,
            metadata=job.user_metadata,
            integrations=list(job.integrations or []),
            method=job.method,
            user_provided_suffix=job.suffix,
            started_at=job.started_at,
            current_step=job.current_step,
            total_steps=job.total_steps,
            # OpenAI: null unless the job is running
            estimated_finish=job.estimated_finish if job.status == "running" else None,
            queue_position=queue_position if job.status == "queued" else None,
            resources=_resources(job, hp),
        )


def _resources(job: JobFields, hyperparameters: dict[str, Any]) -> dict[str, Any]:
    resources = job_resources(job.resources)
    return {**resources.shown(), "global_batch_size": global_batch_size(hyperparameters, resources.ranks)}


class EventObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: str
    message: str
    type: str
    data: dict[str, Any] | None

    @classmethod
    def of(cls, event: JobEvent) -> EventObject:
        return cls(
            id=event.id,
            created_at=event.created_at,
            level=event.level,
            message=event.message,
            type=event.type,
            data=event.data,
        )


class CheckpointObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: dict[str, float]
    step_number: int
    # extensions
    bytes: int
    is_final: bool

    @classmethod
    def of(cls, ckpt: Checkpoint) -> CheckpointObject:
        return cls(
            id=ckpt.id,
            created_at=ckpt.created_at,
            fine_tuned_model_checkpoint=ckpt.fine_tuned_model_checkpoint,
            fine_tuning_job_id=ckpt.job_id,
            metrics=ckpt.metrics,
            step_number=ckpt.step,
            bytes=ckpt.bytes,
            is_final=ckpt.is_final,
        )


def metric_object(row: JobMetric) -> dict[str, Any]:
    return {"object": "fine_tuning.job.metric", "step": row.step, "epoch": row.epoch, **row.values}
