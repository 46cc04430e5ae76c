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


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TUNEHOUSE_", extra="ignore")

    # where the embedded defaults keep their state
    data_dir: Path = Path(".tunehouse")
    # SQLAlchemy URL; empty = SQLite file under data_dir
    database_url: str = ""
    # Celery broker URL; empty = kombu's server-less filesystem transport under data_dir
    broker_url: str = ""
    # Redis for live metric pub/sub; empty = no pub/sub (the DB still has every row)
    redis_url: str = ""
    # blob store: a local folder (default data_dir/blobs); s3:// URLs are refused until implemented
    blob_url: str = ""

    # the API logs one line per request (method, path, status, time, request id) at INFO
    log_level: str = "INFO"

    # uploads
    max_upload_bytes: int = 512 * 1024 * 1024
    min_examples: int = 1
    upload_chunk_bytes: int = 1024 * 1024

    # operator's model registry: {"name": "/local/path", ...}; the tiny demo model is always listed
    model_registry: dict[str, str] = Field(default_factory=dict)
    allow_hub_models: bool = False

    # RL graders: tenant Python code runs only when the operator enables it, in a separate process
    allow_python_grader: bool = False
    python_grader_timeout_seconds: float = 30.0
    python_grader_memory_mb: int = 1024

    # worker lease: a running job whose heartbeat is older than this is considered dead
    heartbeat_seconds: float = 5.0
    lease_timeout_seconds: float = 60.0
    # how often the trainer process looks for cancel/pause in the DB
    control_poll_seconds: float = 0.5
    # metrics are buffered and flushed at least this often
    metrics_flush_seconds: float = 0.5

    @model_validator(mode="after")
    def _fill_embedded_defaults(self) -> Settings:
        self.data_dir = self.data_dir.expanduser().resolve()
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'tunehouse.sqlite'}"
        if not self.broker_url:
            self.broker_url = "filesystem://"
        if not self.blob_url:
            self.blob_url = str(self.data_dir / "blobs")
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

    def celery_transport_options(self) -> dict[str, Any]:
        if self.is_embedded_broker:
            folder = str(self.broker_folder)
            return {"data_folder_in": folder, "data_folder_out": folder, "control_folder": folder}
        # A training job outlives Redis' default 1 h visibility timeout; the DB lease, not the
        # broker, decides who runs a job, so a redelivered message is harmless (see worker/lease.py).
        return {"visibility_timeout": 12 * 3600}


@lru_cache
def get_settings() -> Settings:
    return Settings()
