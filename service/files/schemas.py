"""Files API objects, in OpenAI's shape plus our extensions (format, line_count, sha256)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer
from pydantic.json_schema import SkipJsonSchema

from service.models import File

# OpenAI's published file object has these as an integer and a string, optional and never null. Files
# here do not expire, and a file that fails validation is refused, not stored with details: both are
# left out of every file object (a null would break clients that follow that schema)
_ABSENT_UNLESS_SET = ("expires_at", "status_details")


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)  # a null default is what the schema rules out


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | SkipJsonSchema[None] = Field(default=None, json_schema_extra=_no_default)
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    status_details: str | SkipJsonSchema[None] = Field(default=None, json_schema_extra=_no_default)
    # extensions
    format: str
    line_count: int
    sha256: str
    images: int = 0  # image parts of its rows (docs/vision.md): GET /v1/files/{id}/images lists them

    # no return annotation: pydantic then documents the fields above; an annotated return type would be
    # documented instead of them
    @model_serializer(mode="wrap")
    def _leave_out_unset(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        data: dict[str, Any] = handler(self)
        for key in _ABSENT_UNLESS_SET:
            if data.get(key) is None:
                data.pop(key, None)
        return data

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
