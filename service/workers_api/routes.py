"""GET /v1/workers: every live training worker of the deployment (seen within a lease timeout), what its
devices are and are doing (GPU utilisation and memory, its processes' RSS: worker/devices.py, written at
each reconciler pass), when it was last seen, and the caller's jobs it is running (another tenant's jobs
are counted, never shown)."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel
from sqlalchemy import select

from service.auth import TenantDep
from service.dependencies import SessionDep, SettingsDep
from service.errors import error_responses
from service.models import Job, Worker

router = APIRouter(prefix="/v1/workers", tags=["workers"], responses=error_responses(400, 401, 503))


class WorkerJob(BaseModel):
    id: str
    model: str
    current_step: int
    total_steps: int | None


class WorkerObject(BaseModel):
    id: str
    object: Literal["worker"] = "worker"
    queue: str
    gpus: int  # devices it gives one job
    device: str  # "cuda" or "cpu"
    device_name: str | None
    device_memory_bytes: int | None
    seen_at: float  # its last heartbeat (a reconciler pass)
    # its devices' live figures: {"gpus": [{index, name, utilization, memory_used_bytes,
    # memory_total_bytes}], "rss_bytes", "sampled_at"}
    stats: dict[str, Any] | None
    jobs: list[WorkerJob]  # the caller's running jobs on it
    other_jobs: int  # other organizations' running jobs on it


class WorkerList(BaseModel):
    object: Literal["list"] = "list"
    data: list[WorkerObject]


@router.get("", response_model=WorkerList)
def list_workers(session: SessionDep, tenant: TenantDep, settings: SettingsDep) -> WorkerList:
    cutoff = time.time() - settings.lease_timeout_seconds
    workers = session.scalars(select(Worker).where(Worker.seen_at >= cutoff).order_by(Worker.id)).all()
    running = session.execute(
        select(Job.worker_id, Job.tenant_id, Job.id, Job.model, Job.current_step, Job.total_steps).where(
            Job.status == "running", Job.worker_id.in_([w.id for w in workers])
        )
    ).all()
    data = []
    for w in workers:
        mine = [r for r in running if r.worker_id == w.id and r.tenant_id == tenant.id]
        others = sum(1 for r in running if r.worker_id == w.id and r.tenant_id != tenant.id)
        data.append(
            WorkerObject(
                id=w.id,
                queue=w.queue,
                gpus=w.gpus,
                device=w.device,
                device_name=w.device_name,
                device_memory_bytes=w.device_memory_bytes,
                seen_at=w.seen_at,
                stats=w.stats,
                jobs=[
                    WorkerJob(id=r.id, model=r.model, current_step=r.current_step, total_steps=r.total_steps)
                    for r in mine
                ],
                other_jobs=others,
            )
        )
    return WorkerList(data=data)
