"""The blob store for uploaded files and checkpoints, chosen by `TUNEHOUSE_BLOB_URL`: a local folder
(the default, data_dir/blobs) or `s3://bucket/prefix`. Everything reads and writes through
:class:`BlobStore` (service/storage/base.py)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from service.config import get_settings
from service.errors import NotImplementedYet
from service.storage.base import BlobStore, BlobStoreUnavailable, BlobWriter
from service.storage.local import LocalBlobStore
from service.storage.s3 import S3BlobStore

__all__ = [
    "BlobStore",
    "BlobStoreUnavailable",
    "BlobWriter",
    "LocalBlobStore",
    "S3BlobStore",
    "get_blob_store",
]


@lru_cache
def get_blob_store() -> BlobStore:
    settings = get_settings()
    url = settings.blob_url
    if url.startswith("s3://"):
        return S3BlobStore(url, part_bytes=settings.blob_part_bytes)
    if "://" in url and not url.startswith("file://"):
        raise NotImplementedYet(
            f"blob store {url.split('://')[0]}:// is not supported; use s3://bucket/prefix or a local folder"
        )
    return LocalBlobStore(Path(url.removeprefix("file://")))
