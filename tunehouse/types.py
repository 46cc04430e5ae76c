"""Typed objects the API returns. Unknown fields are kept (`extra="allow"`), so a newer server does not
break an older SDK."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

JobStatus = Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled", "paused"]
TERMINAL_STATUSES: tuple[str, ...] = ("succeeded", "failed", "cancelled")


class _Object(BaseModel):
    model_config = ConfigDict(extra="allow")


class FileObject(_Object):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    format: str | None = None
    line_count: int | None = None
    sha256: str | None = None
    images: int | None = None


class FileDeleted(_Object):
    id: str
    deleted: bool


class JobError(_Object):
    code: str
    message: str
    param: str | None = None
    fault: Literal["user", "system"] | None = None


class FineTuningJob(_Object):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None = None
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    hyperparameters: dict[str, Any] = {}
    model: str
    organization_id: str
    seed: int
    status: JobStatus
    trained_tokens: int | None = None
    training_file: str
    validation_file: str | None = None
    metadata: dict[str, str] | None = None
    method: dict[str, Any]
    # experiment trackers, OpenAI's shape: [{"type": "wandb", "wandb": {"project": ...}}, ...]
    integrations: list[dict[str, Any]] = []
    user_provided_suffix: str | None = None
    started_at: int | None = None
    current_step: int = 0
    # extension: 1-based place in the fair start order while queued, else None
    queue_position: int | None = None
    total_steps: int | None = None
    # extension: {"nodes", "gpus_per_node", "gpus", "strategy", "global_batch_size"}: what the job trains on
    resources: dict[str, Any] = {}

    @property
    def done(self) -> bool:
        return self.status in TERMINAL_STATUSES


class JobEvent(_Object):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: str
    message: str
    type: str
    data: dict[str, Any] | None = None


class Checkpoint(_Object):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: dict[str, float]
    step_number: int
    bytes: int | None = None
    is_final: bool = False


class MetricRow(_Object):
    """One optimizer step's metrics; method-specific keys (loss, reward, ...) are extra fields."""

    object: Literal["fine_tuning.job.metric"] = "fine_tuning.job.metric"
    step: int
    epoch: float

    def value(self, key: str) -> float | None:
        raw = (self.model_extra or {}).get(key)
        return float(raw) if isinstance(raw, int | float) else None


class StreamEnd(_Object):
    """The last item of a live stream: the job reached a terminal state."""

    object: Literal["fine_tuning.job.stream_end"] = "fine_tuning.job.stream_end"
    status: JobStatus


StreamItem = JobEvent | MetricRow | StreamEnd


class WebhookEndpoint(_Object):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    # None: every event type
    events: list[str] | None = None
    description: str | None = None
    created_at: int
    # only in the answer to `webhooks.create`: the signing secret is never shown again
    secret: str | None = None


class WebhookEndpointDeleted(_Object):
    id: str
    deleted: bool


class WebhookAttempt(_Object):
    attempt: int
    started_at: float
    duration_ms: float
    status_code: int | None = None
    error: str | None = None


class WebhookDelivery(_Object):
    id: str
    object: Literal["webhook.delivery"] = "webhook.delivery"
    event_id: str
    event_type: str
    status: Literal["pending", "delivered", "failed"]
    created_at: int
    delivered_at: int | None = None
    next_attempt_at: float | None = None
    last_status_code: int | None = None
    last_error: str | None = None
    event: dict[str, Any]
    attempts: list[WebhookAttempt]


class JobEstimate(_Object):
    """A job's pre-flight estimate (`client.fine_tuning.jobs.estimate`): nothing was created. The parts
    are documented in docs/api.md; `peak_memory_bytes` has one entry per kind of live training worker."""

    object: Literal["fine_tuning.job.estimate"] = "fine_tuning.job.estimate"
    model: str
    method: str
    examples: int
    trained_examples: int | None = None
    trained_tokens: dict[str, int] | None = None
    tokens_reason: str | None = None
    total_steps: int
    truncated: dict[str, Any] | None = None
    images: dict[str, int] | None = None
    peak_memory_bytes: list[dict[str, Any]]
    estimated_wall_time: dict[str, Any]
    queue_position: int
    preview: list[list[dict[str, Any]]]
    # false: the job would train nothing, or fits no live worker (`reason` says which); null: unknown
    fits: bool | None = None
    reason: str | None = None


class ModelTrainable(_Object):
    """What this deployment can train on a base model."""

    methods: list[str]
    lora: bool
    full: bool
    quantization: list[str]
    reason: str | None = None


class Model(_Object):
    """A model of `client.models`: a base model (with what it is and what trains on it) or one of the
    organization's fine-tuned models (the base-model fields are None)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    architecture: str | None = None
    parameters: int | None = None
    context_length: int | None = None
    chat_template: str | None = None
    modalities: list[str] | None = None
    trainable: ModelTrainable | None = None
    source: str | None = None
    revision: str | None = None
    bytes: int | None = None


class ModelDeleted(_Object):
    id: str
    deleted: bool


class _ChatAnswer(_Object):
    id: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ChatCompletion(_ChatAnswer):
    """The answer of `client.chat.completions.create` (OpenAI's shape; `choices[i].message`)."""

    object: Literal["chat.completion"] = "chat.completion"

    @property
    def text(self) -> str:
        """The first choice's content."""
        return str(self.choices[0]["message"].get("content") or "")


class ChatCompletionChunk(_ChatAnswer):
    """One piece of a streamed chat completion (`client.chat.completions.stream`)."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"

    @property
    def text(self) -> str:
        """The first choice's new text, "" when it has none."""
        if not self.choices:
            return ""
        return str(self.choices[0].get("delta", {}).get("content") or "")
