"""`client.files`: upload, list, retrieve, delete and download training files."""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

from tunehouse._base_client import AsyncTransport, SyncTransport
from tunehouse._pagination import AsyncPage, SyncPage
from tunehouse.types import FileDeleted, FileObject

FileInput = str | Path | bytes | IO[bytes]


def _file_part(file: FileInput) -> tuple[str, Any]:
    if isinstance(file, str | Path):
        path = Path(file)
        return path.name, path.open("rb")
    if isinstance(file, bytes):
        return "upload.jsonl", file
    return Path(getattr(file, "name", "upload.jsonl")).name, file


def _list_params(purpose: str | None, after: str | None, limit: int | None) -> dict[str, Any]:
    params: dict[str, Any] = {"purpose": purpose, "after": after, "limit": limit}
    return {k: v for k, v in params.items() if v is not None}


class Files:
    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport

    def create(
        self, *, file: FileInput, purpose: str = "fine-tune", timeout: float | None = None
    ) -> FileObject:
        name, content = _file_part(file)
        try:
            response = self._t.request(
                "POST",
                "/v1/files",
                files={"file": (name, content)},
                data={"purpose": purpose},
                timeout=timeout,
            )
        finally:
            if isinstance(file, str | Path):
                content.close()
        return FileObject.model_validate(response.json())

    def list(
        self, *, purpose: str | None = None, after: str | None = None, limit: int | None = None
    ) -> SyncPage[FileObject]:
        body = self._t.request("GET", "/v1/files", params=_list_params(purpose, after, limit)).json()
        return SyncPage(
            [FileObject.model_validate(x) for x in body["data"]],
            body["has_more"],
            lambda cursor: self.list(purpose=purpose, after=cursor, limit=limit),
        )

    def retrieve(self, file_id: str) -> FileObject:
        return FileObject.model_validate(self._t.request("GET", f"/v1/files/{file_id}").json())

    def delete(self, file_id: str) -> FileDeleted:
        return FileDeleted.model_validate(self._t.request("DELETE", f"/v1/files/{file_id}").json())

    def content(self, file_id: str) -> bytes:
        return self._t.request("GET", f"/v1/files/{file_id}/content").content


class AsyncFiles:
    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport

    async def create(
        self, *, file: FileInput, purpose: str = "fine-tune", timeout: float | None = None
    ) -> FileObject:
        name, content = _file_part(file)
        try:
            response = await self._t.request(
                "POST",
                "/v1/files",
                files={"file": (name, content)},
                data={"purpose": purpose},
                timeout=timeout,
            )
        finally:
            if isinstance(file, str | Path):
                content.close()
        return FileObject.model_validate(response.json())

    async def list(
        self, *, purpose: str | None = None, after: str | None = None, limit: int | None = None
    ) -> AsyncPage[FileObject]:
        body = (await self._t.request("GET", "/v1/files", params=_list_params(purpose, after, limit))).json()
        return AsyncPage(
            [FileObject.model_validate(x) for x in body["data"]],
            body["has_more"],
            lambda cursor: self.list(purpose=purpose, after=cursor, limit=limit),
        )

    async def retrieve(self, file_id: str) -> FileObject:
        return FileObject.model_validate((await self._t.request("GET", f"/v1/files/{file_id}")).json())

    async def delete(self, file_id: str) -> FileDeleted:
        return FileDeleted.model_validate((await self._t.request("DELETE", f"/v1/files/{file_id}")).json())

    async def content(self, file_id: str) -> bytes:
        return (await self._t.request("GET", f"/v1/files/{file_id}/content")).content
