"""Files API objects, in OpenAI's shape plus our extensions (format, line_count, sha256)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from service.models import File


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    status_details: str | None = None
    # extensions
    format: str
    line_count: int
    sha256: str

    @classmethod
    def of(cls, row: File) -> FileObject:
        return cls(
            id=row.id,
            bytes=row.bytes,
            created_at=row.created_at,
            filename=row.filename,
            purpose=row.purpose,
            format=row.format,
            line_count=row.line_count,
            sha256=row.sha256,
        )


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True
