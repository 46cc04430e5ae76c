"""HTTP routes for /v1/fine_tuning/jobs: parse, authorize, call the service."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session
from starlette.convertors import StringConvertor, register_url_convertor

from service.auth import ApiKeyDep, KeyWatch, TenantDep
from service.db_reads import CompiledRead
from service.dependencies import After, Limit, SessionDep, SettingsDep, read_row
from service.downloads import blob_response
from service.errors import BadRequest, error_responses
from service.jobs import creation, estimate, idempotency, repository, service, transitions
from service.jobs.estimate_schemas import EstimateObject
from service.jobs.fairness import queue_positions
from service.jobs.schemas import CheckpointObject, EventObject, JobObject, metric_object
from service.jobs.spec import JobCreate
from service.jobs.stream import CURSOR_PATTERN, Cursor, job_stream, key_recheck_seconds
from service.models import Job
from service.pagination import list_body
from trainers.registry import MAX_STEPS

router = APIRouter(
    prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"], responses=error_responses(400, 401, 503)
)
# a route that names a job answers 404 for one that is not the caller's; a state change can also be 409
_JOB = error_responses(404)


class _JobId(StringConvertor):
    """A job id as a path's last segment: any but `estimate`, the collection's own POST. OpenAPI matches
    a concrete path before a templated one, so GET .../jobs/estimate is a 405 naming POST, not a lookup
    of a job called "estimate" (Schemathesis' Allow check, issue 56)."""

    regex = "(?!estimate$)[^/]+"


register_url_convertor("job_id", _JobId())
_STATE_CHANGE = error_responses(404, 409)


def _objects(session: Session, jobs: Sequence[Job]) -> list[JobObject]:
    """The API objects of `jobs`, queued ones with their queue position (one query for them all)."""
    positions = queue_positions(session, [j.id for j in jobs if j.status == "queued"])
    return [JobObject.of(j, queue_position=positions.get(j.id)) for j in jobs]


def _object(session: Session, job: Job) -> JobObject:
    return _objects(session, [job])[0]


IdempotencyKeyHeader = Annotated[
    str | None,
    Header(
        alias=idempotency.HEADER,
        min_length=1,
        max_length=idempotency.MAX_KEY_CHARS,
        pattern=r"^[\x21-\x7e]+$",
        description="A key of your choosing, reused on retries of the same create: the retry returns the "
        "job the first request created (scoped to your organization). The same key with a different "
        "body is a 409.",
    ),
]


@router.post("", response_model=JobObject, responses=error_responses(409, 413))
def create_job(
    spec: JobCreate,
    session: SessionDep,
    tenant: TenantDep,
    settings: SettingsDep,
    idempotency_key: IdempotencyKeyHeader = None,
) -> JobObject:
    job = idempotency.create_once(
        session,
        tenant=tenant,
        key=idempotency_key,
        spec=spec,
        create=lambda: creation.create_job(session, tenant=tenant, spec=spec, settings=settings),
    )
    return _object(session, job)


@router.post("/estimate", response_model=EstimateObject, responses=error_responses(413))
def estimate_job(
    spec: JobCreate, session: SessionDep, tenant: TenantDep, settings: SettingsDep
) -> EstimateObject:
    """Extension: the pre-flight estimate of a job creation body (the same checks; nothing is created or
    queued): trained tokens, steps, truncated examples, peak memory per device on each kind of live
    worker and whether it fits, the estimated wall time, the queue position, and the first examples with
    the tokens the loss trains on marked. Its data is read on an inference worker (503 when none runs)."""
    return estimate.estimate_job(session, tenant=tenant, spec=spec, settings=settings)


@router.get("")
def list_jobs(
    request: Request, session: SessionDep, tenant: TenantDep, after: After = None, limit: Limit = 20
) -> dict[str, Any]:
    metadata = service.metadata_filter(dict(request.query_params))
    rows, has_more = service.list_jobs(session, tenant=tenant, after=after, limit=limit, metadata=metadata)
    return list_body([o.model_dump() for o in _objects(session, rows)], has_more)


_JOB_READ = CompiledRead(repository.job_read_query())


@router.get("/{job_id:job_id}", response_model=JobObject, responses=_JOB)
async def retrieve_job(job_id: str, tenant: TenantDep) -> JobObject:
    # the call a polling dashboard makes most: no thread (bench/test_api_throughput.py)
    row = await read_row(_JOB_READ, {"job_id": job_id, "tenant_id": tenant.id})
    if row is None:
        raise service.no_such_job(job_id)
    return JobObject.of(row, queue_position=row.queue_position)


@router.post("/{job_id}/cancel", response_model=JobObject, responses=_STATE_CHANGE)
def cancel_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobObject:
    return _object(session, transitions.cancel_job(session, tenant=tenant, job_id=job_id))


@router.post("/{job_id}/pause", response_model=JobObject, responses=_STATE_CHANGE)
def pause_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobObject:
    """A queued job is paused at once; a running one checkpoints at its next step, then is `paused`."""
    return _object(session, transitions.pause_job(session, tenant=tenant, job_id=job_id))


@router.post("/{job_id}/resume", response_model=JobObject, responses=_STATE_CHANGE)
def resume_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobObject:
    """A paused job is queued again and continues from its pause checkpoint."""
    return _object(session, transitions.resume_job(session, tenant=tenant, job_id=job_id))


@router.get("/{job_id}/events", responses=_JOB)
def list_events(
    job_id: str, session: SessionDep, tenant: TenantDep, after: After = None, limit: Limit = 20
) -> dict[str, Any]:
    job = service.get_job(session, tenant=tenant, job_id=job_id)
    rows, has_more = service.list_events(session, job=job, after=after, limit=limit)
    return list_body([EventObject.of(r).model_dump() for r in rows], has_more)


@router.get("/{job_id}/checkpoints", responses=_JOB)
def list_checkpoints(
    job_id: str, session: SessionDep, tenant: TenantDep, after: After = None, limit: Limit = 10
) -> dict[str, Any]:
    job = service.get_job(session, tenant=tenant, job_id=job_id)
    rows, has_more = service.list_checkpoints(session, job=job, after=after, limit=limit)
    return list_body([CheckpointObject.of(r).model_dump() for r in rows], has_more)


@router.get(
    "/{job_id}/checkpoints/{checkpoint_id}/content",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-tar": {}}}, **_JOB},
)
def checkpoint_content(
    job_id: str, checkpoint_id: str, session: SessionDep, tenant: TenantDep
) -> StreamingResponse:
    job = service.get_job(session, tenant=tenant, job_id=job_id)
    ckpt = service.get_checkpoint(session, job=job, checkpoint_id=checkpoint_id)
    return blob_response(ckpt.blob_key, filename=f"{ckpt.id}.tar", media_type="application/x-tar")


@router.get(
    "/{job_id}/stream",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}, **_JOB},
)
def stream_job(
    job_id: str,
    session: SessionDep,
    tenant: TenantDep,
    key: ApiKeyDep,
    settings: SettingsDep,
    last_event_id: Annotated[
        str | None, Header(alias="Last-Event-ID", pattern=CURSOR_PATTERN, examples=["e12m40"])
    ] = None,
) -> StreamingResponse:
    """Extension: events and metric rows as Server-Sent Events; resumable with `Last-Event-ID`. A stream
    whose API key is revoked or expires ends with an `error` event within 5 s."""
    try:
        cursor = Cursor.parse(last_event_id)
    except ValueError as exc:
        raise BadRequest(f"Last-Event-ID: {exc}", param="Last-Event-ID", code="invalid_value") from exc
    service.get_job(session, tenant=tenant, job_id=job_id)
    return StreamingResponse(
        job_stream(
            job_id,
            cursor,
            settings,
            refusal=KeyWatch(key, recheck_seconds=key_recheck_seconds(settings)).refusal,
        ),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


@router.get("/{job_id}/metrics", responses=_JOB)
def list_metrics(
    job_id: str,
    session: SessionDep,
    tenant: TenantDep,
    after: Annotated[int | None, Query(ge=0, le=MAX_STEPS, description="the last step already read")] = None,
    limit: Limit = 1000,
) -> dict[str, Any]:
    job = service.get_job(session, tenant=tenant, job_id=job_id)
    rows, has_more = service.list_metrics(session, job=job, after=after, limit=limit)
    data = [metric_object(r) for r in rows]
    return {"object": "list", "data": data, "has_more": has_more}
