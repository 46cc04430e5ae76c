"""HTTP routes for /v1/fine_tuning/jobs: parse, authorize, call the service."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import StreamingResponse

from service.auth import TenantDep
from service.dependencies import SessionDep, SettingsDep
from service.jobs import service
from service.jobs.schemas import CheckpointObject, EventObject, JobObject, metric_object
from service.jobs.spec import JobCreate
from service.jobs.stream import Cursor, job_stream
from service.pagination import list_body
from service.storage import get_blob_store

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])


@router.post("", response_model=JobObject)
def create_job(spec: JobCreate, session: SessionDep, tenant: TenantDep, settings: SettingsDep) -> JobObject:
    return JobObject.of(service.create_job(session, tenant=tenant, spec=spec, settings=settings))


@router.get("")
def list_jobs(
    request: Request, session: SessionDep, tenant: TenantDep, after: str | None = None, limit: int = 20
) -> dict[str, Any]:
    metadata = service.metadata_filter(dict(request.query_params))
    rows, has_more = service.list_jobs(session, tenant=tenant, after=after, limit=limit, metadata=metadata)
    return list_body([JobObject.of(r).model_dump() for r in rows], has_more)


@router.get("/{job_id}", response_model=JobObject)
def retrieve_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobObject:
    return JobObject.of(service.get_job(session, tenant=tenant, job_id=job_id))


@router.post("/{job_id}/cancel", response_model=JobObject)
def cancel_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobObject:
    return JobObject.of(service.cancel_job(session, tenant=tenant, job_id=job_id))


@router.post("/{job_id}/pause")
def pause_job(job_id: str, session: SessionDep, tenant: TenantDep) -> None:
    service.get_job(session, tenant=tenant, job_id=job_id)
    raise service.not_implemented_control("pausing a job")


@router.post("/{job_id}/resume")
def resume_job(job_id: str, session: SessionDep, tenant: TenantDep) -> None:
    service.get_job(session, tenant=tenant, job_id=job_id)
    raise service.not_implemented_control("resuming a job")


@router.get("/{job_id}/events")
def list_events(
    job_id: str, session: SessionDep, tenant: TenantDep, after: str | None = None, limit: int = 20
) -> dict[str, Any]:
    job = service.get_job(session, tenant=tenant, job_id=job_id)
    rows, has_more = service.list_events(session, job=job, after=after, limit=limit)
    return list_body([EventObject.of(r).model_dump() for r in rows], has_more)


@router.get("/{job_id}/checkpoints")
def list_checkpoints(
    job_id: str, session: SessionDep, tenant: TenantDep, after: str | None = None, limit: int = 10
) -> dict[str, Any]:
    job = service.get_job(session, tenant=tenant, job_id=job_id)
    rows, has_more = service.list_checkpoints(session, job=job, after=after, limit=limit)
    return list_body([CheckpointObject.of(r).model_dump() for r in rows], has_more)


@router.get("/{job_id}/checkpoints/{checkpoint_id}/content")
def checkpoint_content(
    job_id: str, checkpoint_id: str, session: SessionDep, tenant: TenantDep
) -> StreamingResponse:
    job = service.get_job(session, tenant=tenant, job_id=job_id)
    ckpt = service.get_checkpoint(session, job=job, checkpoint_id=checkpoint_id)
    store = get_blob_store()
    return StreamingResponse(
        store.iter_bytes(ckpt.blob_key),
        media_type="application/x-tar",
        headers={
            "content-disposition": f'attachment; filename="{ckpt.id}.tar"',
            "content-length": str(store.size(ckpt.blob_key)),
        },
    )


@router.get("/{job_id}/stream")
def stream_job(
    job_id: str,
    session: SessionDep,
    tenant: TenantDep,
    settings: SettingsDep,
    last_event_id: Annotated[str | None, Header()] = None,
) -> StreamingResponse:
    """Extension: events and metric rows as Server-Sent Events; resumable with `Last-Event-ID`."""
    service.get_job(session, tenant=tenant, job_id=job_id)
    return StreamingResponse(
        job_stream(job_id, Cursor.parse(last_event_id), settings),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


@router.get("/{job_id}/metrics")
def list_metrics(
    job_id: str, session: SessionDep, tenant: TenantDep, after: int | None = None, limit: int = 1000
) -> dict[str, Any]:
    job = service.get_job(session, tenant=tenant, job_id=job_id)
    rows, has_more = service.list_metrics(session, job=job, after=after, limit=limit)
    data = [metric_object(r) for r in rows]
    return {"object": "list", "data": data, "has_more": has_more}
