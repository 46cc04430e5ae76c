"""HTTP routes for /v1/files: parse, authorize, call the service."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from service.auth import TenantDep
from service.dependencies import SessionDep, SettingsDep
from service.files import service
from service.files.schemas import FileDeleted, FileObject
from service.files.upload import receive_upload
from service.ids import new_id
from service.pagination import list_body
from service.storage import get_blob_store

router = APIRouter(prefix="/v1/files", tags=["files"])


@router.post("", response_model=FileObject)
async def upload_file(
    request: Request, session: SessionDep, tenant: TenantDep, settings: SettingsDep
) -> FileObject:
    file_id = new_id("file")
    blob_key = service.new_blob_key(tenant, file_id)
    writer = get_blob_store().writer(blob_key)
    try:
        upload = await receive_upload(
            content_type=request.headers.get("content-type", ""),
            stream=request.stream(),
            writer=writer,
            max_bytes=settings.max_upload_bytes,
            min_examples=settings.min_examples,
        )
        row = await run_in_threadpool(
            service.record_upload, session, tenant=tenant, file_id=file_id, blob_key=blob_key, upload=upload
        )
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return FileObject.of(row)


@router.get("")
def list_files(
    session: SessionDep,
    tenant: TenantDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = 10_000,
    order: str = "desc",
) -> dict[str, object]:
    rows, has_more = service.list_files(
        session, tenant=tenant, purpose=purpose, after=after, limit=limit, order=order
    )
    return list_body([FileObject.of(r).model_dump() for r in rows], has_more)


@router.get("/{file_id}", response_model=FileObject)
def retrieve_file(file_id: str, session: SessionDep, tenant: TenantDep) -> FileObject:
    return FileObject.of(service.get_file(session, tenant=tenant, file_id=file_id))


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, session: SessionDep, tenant: TenantDep) -> FileDeleted:
    service.delete_file(session, tenant=tenant, file_id=file_id)
    return FileDeleted(id=file_id)


@router.get("/{file_id}/content")
def file_content(file_id: str, session: SessionDep, tenant: TenantDep) -> StreamingResponse:
    row = service.get_file(session, tenant=tenant, file_id=file_id)
    return StreamingResponse(
        get_blob_store().iter_bytes(row.blob_key),
        media_type="application/jsonl",
        headers={"content-disposition": f'attachment; filename="{row.filename}"'},
    )
