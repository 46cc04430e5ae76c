"""Downloads streamed to a file: written to `<path>.part` and renamed only when complete, so a path that
exists holds a whole file."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from tunehouse._base_client import AsyncTransport, SyncTransport, Timeout, connection_error, raw
from tunehouse._exceptions import status_error

CHUNK = 1024 * 1024
Progress = Callable[[int, int | None], None]


def _content_length(response: httpx.Response) -> int | None:
    raw_length = response.headers.get("content-length")
    return int(raw_length) if raw_length and raw_length.isdigit() else None


class _Sink:
    """Where the bytes go: `<path>.part`, renamed to `path` only when complete."""

    def __init__(self, path: Path, progress: Progress | None) -> None:
        self.dest = path
        self.tmp = path.with_name(path.name + ".part")
        self.progress = progress
        self.done = 0
        self.total: int | None = None
        self.fh = self.tmp.open("wb")

    def start(self, response: httpx.Response) -> None:
        self.total = _content_length(response)

    def write(self, chunk: bytes) -> None:
        self.fh.write(chunk)
        self.done += len(chunk)
        if self.progress:
            self.progress(self.done, self.total)

    def finish(self) -> Path:
        self.fh.close()
        self.tmp.replace(self.dest)
        return self.dest

    def abort(self) -> None:
        self.fh.close()
        self.tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class Download:
    """GET `url` into `dest`; `progress(done, total)` after each chunk (total None when not announced).
    One try: a large download is not restarted behind the caller's back."""

    url: str
    dest: Path
    progress: Progress | None = None
    timeout: Timeout | None = None

    def run_sync(self, transport: SyncTransport) -> Path:
        sink = _Sink(self.dest, self.progress)
        try:
            with transport.stream(raw("GET", self.url, timeout=self.timeout)) as response:
                if not response.is_success:
                    response.read()
                    raise status_error(response)
                sink.start(response)
                for chunk in response.iter_bytes(CHUNK):
                    sink.write(chunk)
        except httpx.TransportError as exc:
            sink.abort()
            raise connection_error(exc) from exc
        except BaseException:
            sink.abort()
            raise
        return sink.finish()

    async def run_async(self, transport: AsyncTransport) -> Path:
        sink = _Sink(self.dest, self.progress)
        try:
            async with transport.stream(raw("GET", self.url, timeout=self.timeout)) as response:
                if not response.is_success:
                    await response.aread()
                    raise status_error(response)
                sink.start(response)
                async for chunk in response.aiter_bytes(CHUNK):
                    sink.write(chunk)
        except httpx.TransportError as exc:
            sink.abort()
            raise connection_error(exc) from exc
        except BaseException:
            sink.abort()
            raise
        return sink.finish()
