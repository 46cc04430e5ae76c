"""Files API objects, in OpenAI's shape plus our extensions (format, line_count, sha256)."""

from __future__ import annotations

from typing import Any, Literal

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
    images: int = 0  # image parts of its rows (docs/vision.md): GET /v1/files/{id}/images lists them

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
            images=row.images,
        )


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class FileImage(BaseModel):
    """An image of a training file's rows (an extension: GET /v1/files/{id}/images), as the upload checked
    it; ``id`` is its place among the file's images (a page's ``after``)."""

    id: str
    object: Literal["file.image"] = "file.image"
    line: int
    field: str  # the image part's place in its row: messages[1].content[0]
    detail: str
    url: str | None  # the http(s) URL it was fetched from; None for a data URL
    media_type: str
    width: int
    height: int
    bytes: int
    sha256: str
    thumbnail: str | None  # a small WEBP data URL, for the first images of a file

    @classmethod
    def of(cls, entry: dict[str, Any]) -> FileImage:
        return cls(id=str(entry["index"]), **{k: v for k, v in entry.items() if k != "index"})
