"""One typed settings object for every process (API, worker, CLI), read from `TUNEHOUSE_*` env vars.

The defaults are the embedded mode: SQLite, a server-less Celery broker and blobs in a local folder,
all under `data_dir`, so `tunehouse up` needs no Postgres or Redis.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainers.chat.images import DEFAULT_LIMITS as DEFAULT_IMAGE_LIMITS


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TUNEHOUSE_", extra="ignore")

    # where the embedded defaults keep their state
    data_dir: Path = Path(".tunehouse")
    # SQLAlchemy URL; empty = SQLite file under data_dir
    database_url: str = ""
    # Celery broker URL; empty = kombu's server-less filesystem transport under data_dir
    broker_url: str = ""
    # PostgreSQL connections per process (API process, worker, trainer): at most pool + overflow each.
    # Hundreds of workers: lower these and put PgBouncer in front (docs/deploy.md)
    db_pool_size: int = Field(default=10, ge=1)
    db_max_overflow: int = Field(default=20, ge=0)
    # Redis broker: an unacknowledged run message is redelivered after this long. A training job
    # outlives Redis' 1 h default; the DB lease, not the broker, decides who runs a job, so a
    # redelivered message is harmless (service/jobs/lifecycle.py) — this only bounds how often it happens
    broker_visibility_timeout_seconds: float = Field(default=12 * 3600, gt=0)
    # Redis broker: one command (a publish, an ack) or connection attempt gives up after this long. A
    # hung Redis (up, not answering: SIGSTOP, a stalled host, a partition without a reset) would
    # otherwise hold a job's creation until it answers (41 s in issue 46's test); with it the send
    # after commit fails, the API answers and the reconciler re-sends. A send's 3 tries
    # (service/queue.py) take ~4x this: 2.1 s measured at 0.5 s, 4.1 s at 1 s. Workers wait on BRPOP
    # through their event loop (a read only once the socket is readable), which this does not cut
    broker_socket_timeout_seconds: float = Field(default=0.5, gt=0)
    # Redis for live metric pub/sub; empty = no pub/sub (the DB still has every row)
    redis_url: str = ""
    # blob store (uploaded files, checkpoints): a local folder (default data_dir/blobs), which API and
    # workers must share, or `s3://bucket/prefix` for any S3-compatible store; its endpoint, region and
    # credentials are boto3's standard variables (AWS_ENDPOINT_URL, AWS_DEFAULT_REGION,
    # AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)
    blob_url: str = ""
    # part size of multipart uploads to S3: the most an upload holds in memory. S3 refuses parts under
    # 5 MiB (but the last); 8 MiB keeps a 1 GB checkpoint at 128 parts, far under S3's 10,000
    blob_part_bytes: int = Field(default=8 * 1024 * 1024, ge=1)
    # a worker rides out a blob store outage this long (reading a dataset, restoring or uploading a
    # checkpoint), with an event saying so; past it the job fails as a system fault
    blob_outage_tolerance_seconds: float = Field(default=300.0, ge=0)

    # The API admits at most db_pool_size requests to the database at once (service/db_slots.py) and
    # queues the rest on its event loop; the longest a request waits there (or the pool for a free
    # connection) before it is answered 503 with Retry-After
    db_pool_timeout_seconds: float = Field(default=10.0, gt=0)
    # An API key's tenant is cached this long by each API process (service/key_cache.py): a key
    # revoked with `tunehouse keys revoke` (another process) is refused by every server within this
    # many seconds; one revoked through this process is refused at once. 0 disables the cache.
    auth_cache_seconds: float = Field(default=5.0, ge=0)

    # the API logs one line per request (method, path, status, time, request id) at INFO
    log_level: str = "INFO"

    # request limits: a JSON body (a job spec, python grader source included, is a few KB; 100 KB
    # at most per python grader), and the uploaded file, which streams and is bounded separately
    max_json_body_bytes: int = 1024 * 1024

    # Prometheus /metrics shows every tenant's job counts: it is served only when this operator token
    # is set, to requests that send `Authorization: Bearer <token>`
    metrics_token: str = ""

    # uploads
    max_upload_bytes: int = 512 * 1024 * 1024
    min_examples: int = 1
    upload_chunk_bytes: int = 1024 * 1024
    # images in training rows (docs/vision.md): OpenAI's limits by default (trainers/chat/images.py),
    # each a setting; an upload decodes one image at a time, at most image_max_pixels x 4 bytes
    image_max_bytes: int = Field(default=DEFAULT_IMAGE_LIMITS.max_bytes, ge=1)
    image_max_per_example: int = Field(default=DEFAULT_IMAGE_LIMITS.max_per_example, ge=1)
    image_max_examples: int = Field(default=DEFAULT_IMAGE_LIMITS.max_image_examples, ge=0)
    image_formats: list[str] = Field(default_factory=lambda: list(DEFAULT_IMAGE_LIMITS.formats))
    image_modes: list[str] = Field(default_factory=lambda: list(DEFAULT_IMAGE_LIMITS.modes))
    image_max_pixels: int = Field(default=DEFAULT_IMAGE_LIMITS.max_pixels, ge=1)
    image_max_aspect_ratio: float = Field(default=DEFAULT_IMAGE_LIMITS.max_aspect_ratio, ge=1)
    # http(s) image URLs are fetched once, at upload (service/files/fetch.py): a whole fetch's time,
    # its redirects, and whether private, loopback and link-local addresses may be fetched (off: a
    # tenant's file must not reach inside the operator's network)
    image_fetch_timeout_seconds: float = Field(default=10.0, gt=0)
    image_fetch_max_redirects: int = Field(default=3, ge=0, le=20)
    image_fetch_allow_private: bool = False

    # operator's model registry: {"name": "/local/path", ...}; the tiny demo model is always listed
    model_registry: dict[str, str] = Field(default_factory=dict)
    allow_hub_models: bool = False
    # each host's disk cache of the catalogue's base models (`tunehouse models add`; worker/
    # base_model_cache.py), under data_dir/models/base: the least recently used model not in use by any
    # process goes once a fetch takes the cache past this many GB
    model_cache_gb: float = Field(default=100.0, gt=0)

    # RL graders: tenant Python code runs only when the operator enables it, in bubblewrap's sandbox
    # (trainers/rewards/sandbox.py: no network, no other processes, no data or installation dir, uid
    # 65534). Enabled on a host that cannot build the sandbox (no bwrap, namespaces refused), the API and
    # the workers refuse to start and say why; python_grader_unsafe_no_sandbox runs tenant code without
    # it, as the service's own uid with its view of the machine (docs/operations.md warns)
    allow_python_grader: bool = False
    python_grader_unsafe_no_sandbox: bool = False
    python_grader_timeout_seconds: float = 30.0
    python_grader_memory_mb: int = 1024
    # The same two limits bound a grader run of the graders API (POST .../graders/run), which grades
    # in a child process of its own (service/graders/child.py): CPU seconds and wall seconds of
    # python_grader_timeout_seconds, an address space of python_grader_memory_mb.
    # Sizes a grader works on (service/graders/limits.py), each over its cap a 400 naming the field.
    # A text: /run's model_sample, and a string_check/text_similarity input or reference both as
    # written and as expanded ({{item.x}} filled in: /run checks its item, an RL job each row).
    # fuzzy_match's cost grows with the product of its two texts: 20,000 x 20,000 characters is well
    # under a second of CPU; issue 46's 20,000 x 400,000 held the API's CPU for a minute
    grader_max_text_chars: int = Field(default=20_000, ge=1)
    # /run's `item` (one dataset row) as compact JSON; a job's rows are bounded by its file's upload
    grader_max_item_bytes: int = Field(default=64 * 1024, ge=2)
    # the graders of one `multi` (issue 46: validate took one of 2,000)
    grader_max_sub_graders: int = Field(default=16, ge=1)

    # worker lease: a running job whose heartbeat is older than this is considered dead
    heartbeat_seconds: float = 5.0
    lease_timeout_seconds: float = 60.0
    # how often the trainer process looks for cancel/pause in the DB
    control_poll_seconds: float = 0.5
    # metrics are buffered and flushed at least this often
    metrics_flush_seconds: float = 0.5
    # a worker rides out a database outage this long: metrics stay buffered, the writes that must land
    # (events, checkpoint records, the final status) retry; past it the job fails as a system fault.
    # Heartbeats stop meanwhile, so an outage longer than lease_timeout_seconds hands the job to another
    # worker (resumed from its checkpoint) once the database is back.
    db_outage_tolerance_seconds: float = 300.0

    # Dispatch (service/jobs/dispatch.py): a job still `queued` this long after its run message was
    # sent is sent again (the message may be lost: broker restart); later re-sends back off, doubling
    # up to 10 min. A job whose send failed (broker down) is re-sent at the next reconciler pass.
    dispatch_timeout_seconds: float = 60.0
    # how often each worker's reconciler looks for unclaimed queued jobs and stale leases
    reconcile_seconds: float = 5.0
    # a job whose trainer dies (OOM, SIGKILL) or whose worker is lost is restarted from its latest
    # checkpoint at most this many times; the next death fails it with fault "system"
    max_restarts: int = Field(default=3, ge=0)
    # fair share (service/jobs/fairness.py): at most this many running jobs per tenant (0: no limit);
    # a tenant's further jobs wait in the queue, other tenants' jobs start meanwhile
    max_running_jobs_per_tenant: int = Field(default=0, ge=0)
    # the Celery queue this API sends its jobs to and this worker consumes and claims from: worker
    # pools sharing one database and broker are kept apart by name
    job_queue: str = Field(default="tunehouse", min_length=1, max_length=200)
    # GPUs this training worker gives one job (service/jobs/resources.py): it consumes the queues of
    # jobs of 1..N GPUs. Unset: the GPUs torch sees, 1 on a CPU host. On a CPU host N > 1 runs N gloo
    # ranks (for tests and CPU clusters)
    worker_gpus: int | None = Field(default=None, ge=1, le=64)
    # a multi-GPU job's ranks give up on a collective after this long (a hung or dead peer): the job
    # then restarts from its latest checkpoint instead of hanging (trainers/core/distributed.py)
    collective_timeout_seconds: float = Field(default=300.0, gt=0)

    # Multi-node jobs (`resources.nodes` > 1) run on the operator's Ray cluster (worker/ray_driver.py,
    # docs/ray.md): `ray://head:10001` (Ray Client) or `host:port` of a head whose cluster this host has
    # joined. Unset: a nodes > 1 job is refused (400). Set on the API (to accept such jobs) and on the
    # workers that drive them (they consume the pool's Ray queue).
    ray_address: str | None = Field(default=None, min_length=1)
    # the address the driver's Ray node uses (`ray.init(_node_ip_address=...)`): a host with several
    # interfaces names the one its Ray node listens on; unset: Ray's choice
    ray_node_ip_address: str | None = Field(default=None, min_length=1)
    # the most nodes one job may ask for (a 400 above it)
    max_nodes: int = Field(default=16, ge=1, le=1024)
    # CPUs each rank reserves on its node (its data loading and, without GPUs, its training)
    ray_cpus_per_rank: float = Field(default=1.0, gt=0)
    # how long the driver waits for the cluster to have room for the job's nodes before it hands the
    # job back to the queue (it says why in the job's events first)
    ray_wait_seconds: float = Field(default=600.0, gt=0)
    # how long an unreachable Ray cluster holds a claimed job back before it returns to the queue
    ray_retry_seconds: float = Field(default=30.0, ge=0)
    # resumable checkpoint at least every N minutes of training, for jobs that do not set
    # `save_minutes` (0: only `save_steps` and the end)
    checkpoint_minutes: float = Field(default=10.0, ge=0)
    # resumable training states kept per job (older checkpoints stay downloadable, not resumable)
    checkpoint_keep: int = Field(default=3, ge=1)
    # SIGTERM to a worker: its trainer checkpoints and hands the job back; after this long it is killed
    # and the job resumes from its previous checkpoint instead
    shutdown_grace_seconds: float = 60.0
    # a trainer process started ahead of the worker's next one-rank job, its imports done (the imports
    # are most of the time from claim to first step; it holds a few hundred MB while idle):
    # worker/spare_trainer.py
    spare_trainer: bool = True
    # LoRA jobs on the same base model (same precision, unquantized) that one worker trains at once in
    # one process holding the base once, turn by turn (worker/shared_runs.py); 1: each job alone
    shared_base_jobs: int = Field(default=4, ge=1, le=64)

    # Webhooks (service/webhooks/, delivered by worker/webhooks.py): a failed delivery is retried after
    # backoff, 2x backoff, 4x ... (capped at webhook_backoff_max_seconds) until webhook_max_attempts
    # attempts in all; the defaults (8 attempts, 5 s doubling) keep retrying for about 10 minutes,
    # enough to ride out a receiver's deploy or restart.
    webhook_max_attempts: int = Field(default=8, ge=1)
    webhook_backoff_seconds: float = Field(default=5.0, gt=0)
    webhook_backoff_max_seconds: float = Field(default=3600.0, gt=0)
    # one attempt's HTTP timeout; a receiver should answer at once and do its work afterwards
    webhook_timeout_seconds: float = Field(default=10.0, gt=0)
    # how often each worker's delivery loop looks for due deliveries
    webhook_poll_seconds: float = Field(default=1.0, gt=0)

    # Inference (/v1/chat/completions, /v1/completions) runs on inference workers (`tunehouse worker
    # --inference`), which keep loaded models in an LRU cache up to this many MB of weights each (the
    # tiny demo model is ~2 MB, SmolLM2-135M ~540 MB in fp32); the least recently used is dropped first
    inference_memory_budget_mb: int = Field(default=4096, ge=1)
    # how long the API waits for an inference worker's next message (the first one includes the wait in
    # the queue and loading the model) before answering 503
    inference_timeout_seconds: float = Field(default=120.0, gt=0)
    # `max_tokens` when a request gives none, and the most a request may ask for
    inference_default_max_tokens: int = Field(default=256, ge=1)
    inference_max_tokens: int = Field(default=4096, ge=1)
    # A Tinker host (`tunehouse worker --tinker`) saves a training client idle this long, with no
    # gradients pending, to the blob store and frees its adapter; its next call restores it exactly
    tinker_idle_seconds: float = Field(default=600.0, gt=0)
    # How many Tinker calls one organization may have waiting on one Tinker worker; past it the API answers
    # 429 with Retry-After (service/tinker/channel.py): a flood waits at its sender, not in the worker
    tinker_max_queued_calls: int = Field(default=256, ge=1)

    @model_validator(mode="after")
    def _fill_embedded_defaults(self) -> Settings:
        self.data_dir = self.data_dir.expanduser().resolve()
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'tunehouse.sqlite'}"
        if not self.broker_url:
            self.broker_url = "filesystem://"
        if not self.blob_url:
            self.blob_url = str(self.data_dir / "blobs")
        if self.blob_url.startswith("s3://") and not self.blob_url[len("s3://") :].split("/")[0]:
            raise ValueError(f"blob_url {self.blob_url!r} names no bucket: use s3://bucket/prefix")
        return self

    @property
    def is_embedded_broker(self) -> bool:
        return self.broker_url.startswith("filesystem://")

    @property
    def broker_folder(self) -> Path:
        return self.data_dir / "broker"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def base_models_dir(self) -> Path:
        return self.models_dir / "base"

    def celery_transport_options(self) -> dict[str, Any]:
        if self.is_embedded_broker:
            folder = str(self.broker_folder)
            # kombu polls the folder once a second by default: a request to try a model would wait up
            # to that long before an inference worker sees it; listing a folder 10x/s costs nothing
            return {
                "data_folder_in": folder,
                "data_folder_out": folder,
                "control_folder": folder,
                "polling_interval": 0.1,
            }
        return {
            "visibility_timeout": self.broker_visibility_timeout_seconds,
            "socket_timeout": self.broker_socket_timeout_seconds,
            "socket_connect_timeout": self.broker_socket_timeout_seconds,
        }


@lru_cache
def get_settings() -> Settings:
    return Settings()
