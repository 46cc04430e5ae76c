"""Lists that page themselves: iterate a page and the next pages are fetched as needed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
from pydantic import BaseModel

from tunehouse._base_client import APIRequest, AsyncTransport, SyncTransport

T = TypeVar("T", bound=BaseModel)


def cursor_of(item: BaseModel) -> Any:
    # lists are keyed by id; metric rows by step
    return getattr(item, "id", None) or getattr(item, "step", None)


class SyncPage(Generic[T]):
    def __init__(self, data: list[T], has_more: bool, fetch_after: Callable[[Any], SyncPage[T]]) -> None:
        self.data = data
        self.has_more = has_more
        self._fetch_after = fetch_after

    def next_page(self) -> SyncPage[T] | None:
        if not self.has_more or not self.data:
            return None
        return self._fetch_after(cursor_of(self.data[-1]))

    def __iter__(self) -> Iterator[T]:
        page: SyncPage[T] | None = self
        while page is not None:
            yield from page.data
            page = page.next_page()


class AsyncPage(Generic[T]):
    def __init__(
        self, data: list[T], has_more: bool, fetch_after: Callable[[Any], Awaitable[AsyncPage[T]]]
    ) -> None:
        self.data = data
        self.has_more = has_more
        self._fetch_after = fetch_after

    async def next_page(self) -> AsyncPage[T] | None:
        if not self.has_more or not self.data:
            return None
        return await self._fetch_after(cursor_of(self.data[-1]))

    async def __aiter__(self) -> AsyncIterator[T]:
        page: AsyncPage[T] | None = self
        while page is not None:
            for item in page.data:
                yield item
            page = await page.next_page()


@dataclass(frozen=True)
class PageRequest(Generic[T]):
    """A GET of one page of a list (`{"data": [...], "has_more": ...}`); the next page is the same
    request with `after` set to the last item's cursor."""

    request: APIRequest[httpx.Response]
    item: type[T]

    def _read(self, response: httpx.Response) -> tuple[list[T], bool]:
        body = response.json()
        return [self.item.model_validate(x) for x in body["data"]], bool(body["has_more"])

    def after(self, cursor: Any) -> PageRequest[T]:
        return PageRequest(self.request.with_params(after=cursor), self.item)

    def run_sync(self, transport: SyncTransport) -> SyncPage[T]:
        data, has_more = self._read(transport.send(self.request))
        return SyncPage(data, has_more, lambda cursor: self.after(cursor).run_sync(transport))

    async def run_async(self, transport: AsyncTransport) -> AsyncPage[T]:
        data, has_more = self._read(await transport.send(self.request))
        return AsyncPage(data, has_more, lambda cursor: self.after(cursor).run_async(transport))
