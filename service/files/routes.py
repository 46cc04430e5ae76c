"""HTTP routes for /v1/files: parse, authorize, call the service."""

from __future__ import annotations

from contextlib import closing
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from service.auth import TenantDep
from service.dependencies import After, Limit, SessionDep, SettingsDep
from service.downloads import blob_response
from service.errors import BadRequest, error_responses
from service.files import service
from service.files.fetch import ImageFetcher
from service.files.images import UploadImages, image_limits, read_manifest
from service.files.schemas import FileDeleted, FileImage, FileObject
from service.files.upload import receive_upload
from service.ids import new_id
from service.pagination import MAX_LIMIT, list_body
from service.storage import get_blob_store

router = APIRouter(prefix="/v1/files", tags=["files"], responses=error_responses(400, 401, 503))

# The upload is parsed by hand (service/files/upload.py streams it), so FastAPI cannot infer its body.
_UPLOAD_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        # text, not bytes: the file must be UTF-8 (its lines are then validated)
                        "file": {
                            "type": "string",
                            "contentMediaType": "application/jsonl",
                            "minLength": 1,
                            "description": "A JSONL training file in UTF-8, validated line by line",
                        },
                        "purpose": {"type": "string", "enum": list(service.PURPOSES)},
                    },
                },
                "encoding": {"file": {"contentType": "application/jsonl; charset=utf-8"}},
            }
        },
    }
}


@router.post("", response_model=FileObject, openapi_extra=_UPLOAD_BODY, responses=error_responses(413))
async def upload_file(
    request: Request, session: SessionDep, tenant: TenantDep, settings: SettingsDep
) -> FileObject:
    file_id = new_id("file")
    blob_key = service.new_blob_key(tenant.id, file_id)
    blobs = get_blob_store()
    writer = blobs.writer(blob_key)
    limits = image_limits(settings)
    fetch = ImageFetcher(
        max_bytes=limits.max_bytes,
        timeout_seconds=settings.image_fetch_timeout_seconds,
        max_redirects=settings.image_fetch_max_redirects,
        allow_private=settings.image_fetch_allow_private,
    )
    images = UploadImages(limits, fetch=fetch, blobs=blobs, blob_key=blob_key)
    try:
        upload = await receive_upload(
            content_type=request.headers.get("content-type", ""),
            stream=request.stream(),
            writer=writer,
            max_bytes=settings.max_upload_bytes,
            min_examples=settings.min_examples,
            images=images,
        )
        row = await run_in_threadpool(
            service.record_upload, session, tenant=tenant, file_id=file_id, blob_key=blob_key, upload=upload
        )
        # the blob store may be a network call away (S3): off the event loop
        await run_in_threadpool(images.commit)
        await run_in_threadpool(writer.commit)
    except BaseException:
        # shielded: a cancelled request (client gone) must still drop its half-written blobs
        with anyio.CancelScope(shield=True):
            await run_in_threadpool(writer.abort)
            await run_in_threadpool(images.abort)
        raise
    finally:
        fetch.close()
    return FileObject.of(row)


@router.get("")
def list_files(
    session: SessionDep,
    tenant: TenantDep,
    purpose: str | None = None,
    after: After = None,
    limit: Limit = MAX_LIMIT,
    order: service.Order = "desc",
) -> dict[str, object]:
    rows, has_more = service.list_files(
        session, tenant=tenant, purpose=purpose, after=after, limit=limit, order=order
    )
    return list_body([FileObject.of(r).model_dump() for r in rows], has_more)


@router.get("/{file_id}", response_model=FileObject, responses=error_responses(404))
def retrieve_file(file_id: str, session: SessionDep, tenant: TenantDep) -> FileObject:
    return FileObject.of(service.get_file(session, tenant=tenant, file_id=file_id))


@router.delete("/{file_id}", response_model=FileDeleted, responses=error_responses(404))
def delete_file(file_id: str, session: SessionDep, tenant: TenantDep) -> FileDeleted:
    service.delete_file(session, tenant=tenant, file_id=file_id)
    return FileDeleted(id=file_id)


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/jsonl": {}, "text/csv": {}, "application/gzip": {}}},
        **error_responses(404),
    },
)
def file_content(file_id: str, session: SessionDep, tenant: TenantDep) -> StreamingResponse:
    row = service.get_file(session, tenant=tenant, file_id=file_id)
    return blob_response(row.blob_key, filename=row.filename, media_type=service.media_type(row))


@router.get("/{file_id}/images", responses=error_responses(404))
def file_images(
    file_id: str, session: SessionDep, tenant: TenantDep, after: After = None, limit: Limit = 20
) -> dict[str, object]:
    """The images of the file's rows in order (an extension; docs/vision.md), from its manifest: a page
    of ``limit`` after the image whose ``id`` is ``after``, each with its line, field and a thumbnail for
    the first ones."""
    row = service.get_file(session, tenant=tenant, file_id=file_id)
    if after is not None and not after.isdigit():
        raise BadRequest(
            f"after: {after!r} is not an image id (a number)", param="after", code="invalid_value"
        )
    start = int(after) + 1 if after is not None else 0
    page: list[dict[str, object]] = []
    has_more = False
    with closing(read_manifest(get_blob_store(), row.blob_key)) as entries:  # closed when a page is full
        for entry in entries if row.images else ():
            if entry["index"] < start:
                continue
            if len(page) == limit:
                has_more = True
                break
            page.append(FileImage.of(entry).model_dump())
    return list_body(page, has_more)
