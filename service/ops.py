"""The operator's endpoints: liveness, readiness and Prometheus metrics (none in the OpenAPI document,
none behind a tenant's API key).

- `/healthz` answers 200 while the process can answer at all (it touches no dependency and runs on
  the event loop, never waiting for a thread or a database connection), so an orchestrator does not
  restart a healthy API because its database is briefly away or busy.
- `/readyz` answers 503 (with Retry-After) while the database is unreachable, so a load balancer stops
  routing to this instance until it is back.
- `/metrics` shows every tenant's job counts and each live worker's devices (GPU utilisation and memory,
  RSS), so it is served only when `TUNEHOUSE_METRICS_TOKEN` is
  set, and only to requests carrying it as `Authorization: Bearer <token>` (Prometheus:
  `authorization: {credentials: <token>}` in the scrape config).
"""

from __future__ import annotations

import hmac
import time
from typing import Annotated

from fastapi import APIRouter, Header
from fastapi.responses import PlainTextResponse, Response
from sqlalchemy import select, text
from starlette.concurrency import run_in_threadpool

from service.db import get_engine, get_sessionmaker
from service.db_slots import db_slot
from service.dependencies import SettingsDep
from service.errors import RETRY_AFTER_SECONDS, NotFound, Unauthorized
from service.jobs import repository
from service.jobs.schemas import JOB_STATUSES
from service.models import Worker

router = APIRouter(include_in_schema=False)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


def _ping() -> None:
    with get_engine().connect() as conn:
        conn.execute(text("SELECT 1"))


@router.get("/readyz")
async def readyz() -> Response:
    try:
        async with db_slot():
            await run_in_threadpool(_ping)
    except Exception as exc:  # readiness reports, it does not raise (a busy pool included)
        return PlainTextResponse(
            f"database unavailable: {type(exc).__name__}",
            status_code=503,
            headers={"retry-after": str(RETRY_AFTER_SECONDS)},
        )
    return PlainTextResponse("ready")


def _check_operator(token: str, authorization: str | None) -> None:
    if not token:
        raise NotFound(
            "/metrics is disabled; the operator enables it by setting TUNEHOUSE_METRICS_TOKEN",
            code="metrics_disabled",
        )
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Unauthorized("/metrics needs 'Authorization: Bearer <TUNEHOUSE_METRICS_TOKEN>'")


def _job_counts_and_workers(lease_timeout: float) -> tuple[dict[str, int], list[Worker]]:
    with get_sessionmaker()() as session:
        cutoff = time.time() - lease_timeout
        workers = list(session.scalars(select(Worker).where(Worker.seen_at >= cutoff).order_by(Worker.id)))
        return repository.count_by_status(session), workers


def _worker_lines(workers: list[Worker]) -> list[str]:
    """Each live worker's devices as gauges (worker/devices.py samples them at every reconciler pass)."""
    lines = [
        "# HELP tunehouse_worker_rss_bytes Resident memory of a worker and its trainers.",
        "# TYPE tunehouse_worker_rss_bytes gauge",
        "# HELP tunehouse_worker_gpu_utilization_percent A worker's GPU utilisation (NVML).",
        "# TYPE tunehouse_worker_gpu_utilization_percent gauge",
        "# HELP tunehouse_worker_gpu_memory_used_bytes Memory in use on a worker's GPU (NVML).",
        "# TYPE tunehouse_worker_gpu_memory_used_bytes gauge",
    ]
    for w in workers:
        stats = w.stats or {}
        who = f'worker="{_label(w.id)}",device="{w.device}"'
        if stats.get("rss_bytes") is not None:
            lines.append(f"tunehouse_worker_rss_bytes{{{who}}} {stats['rss_bytes']}")
        for gpu in stats.get("gpus") or []:
            one = f'{who},gpu="{gpu["index"]}"'
            lines.append(f"tunehouse_worker_gpu_utilization_percent{{{one}}} {gpu['utilization']}")
            lines.append(f"tunehouse_worker_gpu_memory_used_bytes{{{one}}} {gpu['memory_used_bytes']}")
    return lines


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@router.get("/metrics")
async def prometheus(
    settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
) -> Response:
    _check_operator(settings.metrics_token, authorization)
    async with db_slot():
        counts, workers = await run_in_threadpool(_job_counts_and_workers, settings.lease_timeout_seconds)
    lines = ["# HELP tunehouse_jobs Fine-tuning jobs by status.", "# TYPE tunehouse_jobs gauge"]
    for status in JOB_STATUSES:
        lines.append(f'tunehouse_jobs{{status="{status}"}} {counts.get(status, 0)}')
    lines += _worker_lines(workers)
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")
