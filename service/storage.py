"""The blob store for uploaded files and checkpoints. A local folder today; the interface is what an
S3 store will implement (stream in, stream out, delete)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO

from service.config import get_settings
from service.errors import NotImplementedYet


class LocalBlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise ValueError(f"blob key escapes the store: {key!r}")
        return path

    def writer(self, key: str) -> BlobWriter:
        return BlobWriter(self._path(key))

    def put_file(self, key: str, source: Path) -> int:
        with source.open("rb") as src, self.writer(key) as dst:
            shutil.copyfileobj(src, dst.file, 1024 * 1024)
        return source.stat().st_size

    def open(self, key: str) -> BinaryIO:
        return self._path(key).open("rb")

    def iter_bytes(self, key: str, chunk_size: int = 1024 * 1024) -> Iterator[bytes]:
        with self.open(key) as fh:
            while chunk := fh.read(chunk_size):
                yield chunk

    def size(self, key: str) -> int:
        return self._path(key).stat().st_size

    def get_to_file(self, key: str, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._path(key), dest)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


class BlobWriter:
    """Writes to a temp file beside the target and renames on success: a reader never sees half a blob."""

    def __init__(self, target: Path) -> None:
        self.target = target
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        self.tmp = Path(tmp)
        self.file = os.fdopen(fd, "wb")

    def write(self, data: bytes) -> None:
        self.file.write(data)

    def commit(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.target)

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


@lru_cache
def get_blob_store() -> LocalBlobStore:
    url = get_settings().blob_url
    if "://" in url and not url.startswith("file://"):
        raise NotImplementedYet(
            f"blob store {url.split('://')[0]}:// is not implemented yet; use a local folder"
        )
    return LocalBlobStore(Path(url.removeprefix("file://")))
