"""`client.files`: upload, list, retrieve, delete and download training files.

Each method is written once, for both clients (see `tunehouse._resource`)."""

from __future__ import annotations

import httpx

from tunehouse._base_client import (
    IDEMPOTENCY_HEADER,
    APIRequest,
    FileInput,
    compact,
    new_idempotency_key,
    raw,
)
from tunehouse._pagination import PageRequest
from tunehouse._resource import AsyncAPIResource, SyncAPIResource, endpoint, paged, parse_as
from tunehouse.types import FileDeleted, FileObject

FILES = "/v1/files"

__all__ = ["AsyncFiles", "FileInput", "Files"]


def _content(response: httpx.Response) -> bytes:
    return response.content


class _Files:
    @endpoint
    def create(
        self,
        *,
        file: FileInput,
        purpose: str = "fine-tune",
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> APIRequest[FileObject]:
        """Upload a JSONL file (a path, bytes or a binary file object); it is validated line by line.

        Sent with an `Idempotency-Key` but never retried automatically: the server does not deduplicate
        uploads, so a repeated upload would store the file twice."""
        key = idempotency_key or new_idempotency_key()
        return APIRequest(
            "POST",
            FILES,
            parse_as(FileObject),
            data={"purpose": purpose},
            upload=file,
            headers={IDEMPOTENCY_HEADER: key},
            timeout=timeout,
        )

    @paged
    def list(
        self,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int | None = None,
        timeout: float | None = None,
    ) -> PageRequest[FileObject]:
        params = compact(purpose=purpose, after=after, limit=limit)
        return PageRequest(raw("GET", FILES, params=params, timeout=timeout), FileObject)

    @endpoint
    def retrieve(self, file_id: str, *, timeout: float | None = None) -> APIRequest[FileObject]:
        return APIRequest("GET", f"{FILES}/{file_id}", parse_as(FileObject), timeout=timeout)

    @endpoint
    def delete(self, file_id: str, *, timeout: float | None = None) -> APIRequest[FileDeleted]:
        return APIRequest("DELETE", f"{FILES}/{file_id}", parse_as(FileDeleted), timeout=timeout)

    @endpoint
    def content(self, file_id: str, *, timeout: float | None = None) -> APIRequest[bytes]:
        """The file's bytes, as uploaded."""
        return APIRequest("GET", f"{FILES}/{file_id}/content", _content, timeout=timeout)


class Files(_Files, SyncAPIResource):
    pass


class AsyncFiles(_Files, AsyncAPIResource):
    pass
