"""The blob store's interface: what every reader and writer of uploaded files and checkpoints uses.

Two implementations: a local folder (service/storage/local.py, the default) and any S3-compatible
store (service/storage/s3.py). Both stream: a writer takes chunks and makes the blob visible only on
`commit` (a reader never sees half a blob), `open` returns a file object read chunk by chunk, so
neither side holds a whole dataset or checkpoint in memory.

A missing blob is `FileNotFoundError` (an `OSError`, like a truncated tar: "this blob is damaged").
An unreachable store is `BlobStoreUnavailable`: the API answers it with a 503 and Retry-After, and
the worker retries it (worker/outage.py) instead of taking a checkpoint for damaged.
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from service.errors import ServiceUnavailable

CHUNK_BYTES = 1024 * 1024


class BlobStoreUnavailable(ServiceUnavailable):
    """The store did not answer (connection refused or cut, timeouts, 5xx, a missing bucket)."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        message = f"The blob store is unavailable ({detail}); retry in a few seconds."
        super().__init__(message, code="blob_store_unavailable")


class BlobWriter(ABC):
    """One blob being written: `write` chunks, then `commit` (visible) or `abort` (nothing kept)."""

    @abstractmethod
    def write(self, data: bytes) -> None: ...

    @abstractmethod
    def commit(self) -> None: ...

    @abstractmethod
    def abort(self) -> None:
        """Never raises: it runs while another error is on its way out."""

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class BlobStore(ABC):
    @abstractmethod
    def writer(self, key: str) -> BlobWriter:
        """A writer for `key`; creating it makes no network call, so it is safe on the event loop."""

    @abstractmethod
    def open(self, key: str) -> BinaryIO:
        """The blob as a readable binary file, streamed; `FileNotFoundError` if there is none."""

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key`; a missing key is not an error."""

    def put_file(self, key: str, source: Path) -> int:
        """Store a local file under `key` (read in chunks); returns its size."""
        with source.open("rb") as src, self.writer(key) as dst:
            while chunk := src.read(CHUNK_BYTES):
                dst.write(chunk)
        return source.stat().st_size

    def iter_bytes(self, key: str, chunk_size: int = CHUNK_BYTES) -> Iterator[bytes]:
        with self.open(key) as fh:
            while chunk := fh.read(chunk_size):
                yield chunk

    def copy_to(self, key: str, dest: BinaryIO) -> None:
        with self.open(key) as fh:
            shutil.copyfileobj(fh, dest, CHUNK_BYTES)
