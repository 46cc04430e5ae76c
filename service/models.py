"""SQLAlchemy models: everything that must survive a restart. Change them only with a migration."""

from __future__ import annotations

from typing import Any, ClassVar

from sqlalchemy import JSON, BigInteger, Boolean, Float, ForeignKey, Index, Integer, String, Text, false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from service.ids import now


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSON, list[Any]: JSON}


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    # the public part of the key, used to find the row; the secret is only stored as its hash
    lookup: Mapped[str] = mapped_column(String(32), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    revoked_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # optional expiry (unix seconds), set at creation with `tunehouse keys create --expires-in`
    expires_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class File(Base):
    __tablename__ = "files"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(500))
    purpose: Mapped[str] = mapped_column(String(40))
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    line_count: Mapped[int] = mapped_column(Integer)
    format: Mapped[str] = mapped_column(String(40))
    blob_key: Mapped[str] = mapped_column(String(500))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    # image parts of its rows, and the rows with any (docs/vision.md); a job refuses them on a text model
    images: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    image_examples: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    __table_args__ = (Index("ix_files_tenant_id_id", "tenant_id", "id"),)


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(500))
    training_file: Mapped[str] = mapped_column(String(40))
    validation_file: Mapped[str | None] = mapped_column(String(40), nullable=True)
    # the method object with "auto" already resolved: {"type": T, T: {"hyperparameters": {...}}}
    method: Mapped[dict[str, Any]] = mapped_column(JSON)
    suffix: Mapped[str | None] = mapped_column(String(64), nullable=True)
    seed: Mapped[int] = mapped_column(BigInteger)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, nullable=True)
    # the spec's experiment trackers as given (service/jobs/integrations.py); None: none
    integrations: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    status: Mapped[str] = mapped_column(String(32), default="validating_files")
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    fine_tuned_model: Mapped[str | None] = mapped_column(String(500), nullable=True)
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    started_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    finished_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # progress, for dashboards and `jobs wait`
    total_steps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    current_step: Mapped[int] = mapped_column(Integer, default=0)
    # the lease: which worker runs the job and when it last proved it is alive
    worker_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    heartbeat_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # restarts after a crash (trainer killed, worker lost), bounded by settings.max_restarts; a pause
    # or a worker's graceful hand-back is not a restart
    restarts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # the outbox (service/jobs/dispatch.py): when the job last became queued, and when its run message
    # was last sent (None: the send failed, the reconciler sends it at its next pass)
    queued_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    dispatched_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # POST .../pause on a running job: its trainer checkpoints at its next control poll, then `paused`
    pause_requested: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # while running: when the trainer expects to finish, from its measured step times (worker/progress.py)
    estimated_finish: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # ids of the files the job produced at its end (worker/result_files.py), in OpenAI's `result_files`
    result_files: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    # the Celery queue its run messages go to (settings.job_queue when created); a worker claims only
    # jobs of the queue it consumes (service/jobs/fairness.py)
    queue: Mapped[str] = mapped_column(String(200), default="tunehouse", server_default="tunehouse")
    # what the job runs on, as validated (service/jobs/resources.py): {"gpus": N, "strategy": "ddp"};
    # None: created before resources existed, one GPU
    resources: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    __table_args__ = (
        Index("ix_jobs_tenant_id_id", "tenant_id", "id"),
        Index("ix_jobs_status", "status"),
    )


class IdempotencyKey(Base):
    """A tenant's `Idempotency-Key` for `POST /v1/fine_tuning/jobs` and the job it created
    (service/jobs/idempotency.py): a retried create finds the first job here instead of making a
    second one. Kept as long as the job is."""

    __tablename__ = "idempotency_keys"
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    # sha256 of the request's spec as parsed: the same key with another body is refused (409)
    request_hash: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class Worker(Base):
    """A live training worker and what it can run (service/jobs/capacity.py): each worker re-writes its
    row every reconcile pass and deletes it when it stops; a row not seen for a lease timeout is dead."""

    __tablename__ = "workers"
    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    # the worker pool's base queue (settings.job_queue): the pools sharing one database are apart
    queue: Mapped[str] = mapped_column(String(200))
    # devices it gives one job: GPUs, or on a CPU host the gloo ranks it was told to run
    gpus: Mapped[int] = mapped_column(Integer)
    seen_at: Mapped[float] = mapped_column(Float)
    # what one of its devices is ("cuda" or "cpu"), its name and memory (a CPU host: its RAM): the
    # pre-flight estimate says whether a job fits each kind of worker (service/jobs/estimate.py)
    device: Mapped[str] = mapped_column(String(20), server_default="cpu")
    device_name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    device_memory_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # its devices' live figures at its last pass: {"gpus": [{index, name, utilization, memory_used_bytes,
    # memory_total_bytes}], "rss_bytes", "sampled_at"} (worker/devices.py)
    stats: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class CatalogModel(Base):
    """A base model of the operator's catalogue (`tunehouse models add`, service/base_models/adding.py):
    its files are stored once in the blob store under `blob_prefix`, each with its sha256, and fetched by
    workers on first use (worker/base_model_cache.py)."""

    __tablename__ = "base_models"
    # the name jobs, Tinker clients and /v1/chat/completions use (a hub id, or the operator's name)
    id: Mapped[str] = mapped_column(String(300), primary_key=True)
    # where it came from: a hub id or a local path, as given
    source: Mapped[str] = mapped_column(String(1000))
    # the hub's commit sha, or for a local folder the sha256 of its files' manifest: pinned
    revision: Mapped[str] = mapped_column(String(64))
    blob_prefix: Mapped[str] = mapped_column(String(500))
    # [{"path", "bytes", "sha256"}, ...]
    files: Mapped[list[Any]] = mapped_column(JSON)
    bytes: Mapped[int] = mapped_column(BigInteger)
    # architecture, parameters, context length, chat template, modalities, what it can train
    details: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class JobEvent(Base):
    __tablename__ = "job_events"
    # an integer sequence gives events a strict order even within one millisecond
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    level: Mapped[str] = mapped_column(String(10), default="info")
    message: Mapped[str] = mapped_column(Text)
    type: Mapped[str] = mapped_column(String(20), default="message")
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class JobMetric(Base):
    __tablename__ = "job_metrics"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    epoch: Mapped[float] = mapped_column(Float)
    # {"loss": .., "learning_rate": .., "valid_loss": ..}: methods log different metrics
    values: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    fine_tuned_model_checkpoint: Mapped[str] = mapped_column(String(600))
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    # a tar of the Hugging Face model folder (what users download)
    blob_key: Mapped[str] = mapped_column(String(500))
    # a tar of the training state (optimizer, RNG, data position) to resume from; None for final exports
    state_blob_key: Mapped[str | None] = mapped_column(String(500), nullable=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    is_final: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    # DELETE /v1/models/{name} of a final checkpoint: it no longer lists, serves or trains further; its
    # blobs go once nothing refers to them (service/models_api/lifecycle.py), then blob_key is ""
    deleted_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class TinkerSession(Base):
    """A Tinker SDK session (`ServiceClient`): its training runs and sampling clients belong to it."""

    __tablename__ = "tinker_sessions"
    id: Mapped[str] = mapped_column(String(60), primary_key=True)  # tsession-...
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    # `ServiceClient.close(status)`: success | errored | interrupted, the first one given
    finish_reason: Mapped[str | None] = mapped_column(String(20), nullable=True)
    finished_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class TinkerRun(Base):
    """A Tinker training run (a LoRA training client): what it is and whose. Which host holds its adapter,
    and its live counters (calls, steps, last loss), are transient and stay in Redis
    (service/tinker/service.py); this row outlives a Redis or API restart."""

    __tablename__ = "tinker_runs"
    id: Mapped[str] = mapped_column(String(200), primary_key=True)  # <session>:train:<seq>
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    session_id: Mapped[str] = mapped_column(String(60), index=True)
    base_model: Mapped[str] = mapped_column(String(600))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)  # the LoRA: rank, seed, train_* switches
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class TinkerCheckpoint(Base):
    """A Tinker checkpoint (`save_state`, or `save_weights_for_sampler` with a name) as a tunehouse model:
    its LoRA adapter, served on its run's base model (service/base_models/tinker_checkpoints.py), and the
    run's checkpoint listing (`RestClient.list_checkpoints`, `list_user_checkpoints`)."""

    __tablename__ = "tinker_checkpoints"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # ftckpt-...
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    training_run_id: Mapped[str] = mapped_column(String(200))  # <session>:train:<seq>
    kind: Mapped[str] = mapped_column(String(20))  # weights (save_state) | sampler_weights
    name: Mapped[str] = mapped_column(String(128))
    tinker_path: Mapped[str] = mapped_column(String(600))  # tinker://<run>/<kind>/<name>
    fine_tuned_model: Mapped[str] = mapped_column(
        String(800)
    )  # ft:<base>:<tenant>:tinker:<run>/<kind>/<name>
    base_model: Mapped[str] = mapped_column(String(600))  # what the run trained from (a base or an ft: name)
    # a tar of a peft adapter folder (adapter_config.json, adapter_model.safetensors, the tokenizer)
    blob_key: Mapped[str] = mapped_column(String(500))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    # `ttl_seconds` at save (or set later): the reaper deletes it, row and blobs, after this time
    expires_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    __table_args__ = (
        # saving again under the same name replaces the checkpoint, as in Tinker
        Index("ix_tinker_checkpoints_tenant_path", "tenant_id", "tinker_path", unique=True),
        Index("ix_tinker_checkpoints_tenant_model", "tenant_id", "fine_tuned_model"),
    )


class WebhookEndpoint(Base):
    __tablename__ = "webhook_endpoints"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(String(2048))
    # the event types this endpoint receives; None: every type (service/webhooks/events.py)
    events: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    description: Mapped[str | None] = mapped_column(String(500), nullable=True)
    # `whsec_<base64>`: kept as is, not hashed, because every delivery is signed with it (an HMAC key
    # must be known to the signer); the API shows it only once, in the answer to the creation
    secret: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class WebhookDelivery(Base):
    """The outbox: one row per (endpoint, event), written in the transaction of the state change that
    raised the event; the workers' delivery loop (worker/webhooks.py) sends it."""

    __tablename__ = "webhook_deliveries"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    # the event's id, the Standard Webhooks `webhook-id` (the same on every retry: receivers dedupe by it)
    event_id: Mapped[str] = mapped_column(String(40))
    event_type: Mapped[str] = mapped_column(String(80))
    # the event object, as sent: {"object": "event", "id", "type", "created_at", "data": {"id": job}}
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    # pending -> delivered | failed (after settings.webhook_max_attempts)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[float] = mapped_column(Float)
    # the claim (a compare-and-set): the worker sending it now, until when; an expired claim is free
    claimed_by: Mapped[str | None] = mapped_column(String(200), nullable=True)
    claimed_until: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    delivered_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    __table_args__ = (
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_endpoint_id_id", "endpoint_id", "id"),
    )


class WebhookAttempt(Base):
    """The delivery log: one row per HTTP attempt."""

    __tablename__ = "webhook_attempts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    delivery_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_deliveries.id", ondelete="CASCADE"), index=True
    )
    attempt: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[float] = mapped_column(Float)
    duration_ms: Mapped[float] = mapped_column(Float)
    # None when no HTTP answer came (connection refused, timeout): `error` says why
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    worker_id: Mapped[str] = mapped_column(String(200))
