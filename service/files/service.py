"""Rules for training files: store validated uploads, scope every read to the tenant."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.errors import BadRequest, NotFound
from service.files.images import manifest_key, stored_image_keys
from service.files.upload import UploadResult
from service.models import File, Tenant
from service.pagination import page
from service.storage import BlobStoreUnavailable, get_blob_store

log = logging.getLogger("tunehouse.files")

# what a client may upload; files the service itself writes (a job's results) have their own purpose
PURPOSES = ("fine-tune",)
RESULTS_PURPOSE = "fine-tune-results"
Order = Literal["asc", "desc"]
# the media type of a stored file's content, by its `format` (training files are JSONL of any format)
_MEDIA_TYPES = {"csv": "text/csv", "tar.gz": "application/gzip"}


def media_type(row: File) -> str:
    return _MEDIA_TYPES.get(row.format, "application/jsonl")


def new_blob_key(tenant_id: str, file_id: str, extension: str = "jsonl") -> str:
    return f"files/{tenant_id}/{file_id}.{extension}"


def reference_log_probs_key(tenant_id: str, file_id: str) -> str:
    """Where DPO jobs keep the file's precomputed reference log-probs for the next job on it
    (worker/reference_log_probs.py); derived from the file's rows, so it goes when the file goes."""
    return f"files/{tenant_id}/{file_id}.reference-logps.npz"


def record_upload(
    session: Session, *, tenant: Tenant, file_id: str, blob_key: str, upload: UploadResult
) -> File:
    purpose = upload.fields.get("purpose")
    if purpose is None:
        raise BadRequest(
            "missing required parameter 'purpose'", param="purpose", code="missing_required_parameter"
        )
    if purpose not in PURPOSES:
        raise BadRequest(
            f"purpose '{purpose}' is not supported; use one of {', '.join(PURPOSES)}",
            param="purpose",
            code="invalid_value",
        )
    row = File(
        id=file_id,
        tenant_id=tenant.id,
        filename=upload.filename,
        purpose=purpose,
        bytes=upload.stats.bytes,
        sha256=upload.sha256,
        line_count=upload.stats.line_count,
        format=upload.stats.format.value,
        blob_key=blob_key,
        images=upload.stats.images,
        image_examples=upload.stats.image_examples,
    )
    session.add(row)
    session.flush()
    return row


def get_file(session: Session, *, tenant: Tenant, file_id: str, param: str = "file_id") -> File:
    row = session.scalar(select(File).where(File.id == file_id, File.tenant_id == tenant.id))
    if row is None:
        raise NotFound(f"No such File object: {file_id}", param=param, code="file_not_found")
    return row


def list_files(
    session: Session, *, tenant: Tenant, purpose: str | None, after: str | None, limit: int, order: Order
) -> tuple[Sequence[File], bool]:
    stmt = select(File).where(File.tenant_id == tenant.id)
    if purpose:
        stmt = stmt.where(File.purpose == purpose)
    return page(session, stmt, File.id, after=after, limit=limit, order=order)


def delete_file(session: Session, *, tenant: Tenant, file_id: str) -> None:
    row = get_file(session, tenant=tenant, file_id=file_id)
    session.delete(row)
    session.flush()
    # the row goes first: a crash between the two leaves an orphan blob, never a row without bytes
    session.commit()
    keys = [row.blob_key, reference_log_probs_key(row.tenant_id, row.id)]
    if row.images:  # the fetched images, then their manifest (service/files/images.py)
        try:
            keys = [*stored_image_keys(get_blob_store(), row.blob_key), manifest_key(row.blob_key), *keys]
        except BlobStoreUnavailable as exc:
            log.warning("file %s: its images were not deleted: %s", file_id, exc.message)
    for key in keys:
        try:
            get_blob_store().delete(key)
        except BlobStoreUnavailable as exc:  # the file is gone for the client; the blob is an orphan
            log.warning("file %s: blob %s not deleted: %s", file_id, key, exc.message)
