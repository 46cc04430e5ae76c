"""The default blob store: a local folder (data_dir/blobs), shared by API and workers on one host."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO

from service.storage.base import BlobStore, BlobWriter


class LocalBlobStore(BlobStore):
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise ValueError(f"blob key escapes the store: {key!r}")
        return path

    def writer(self, key: str) -> LocalBlobWriter:
        return LocalBlobWriter(self._path(key))

    def open(self, key: str) -> BinaryIO:
        return self._path(key).open("rb")

    def size(self, key: str) -> int:
        return self._path(key).stat().st_size

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


class LocalBlobWriter(BlobWriter):
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
