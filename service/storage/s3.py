"""Blobs in any S3-compatible store (AWS S3, MinIO, Ceph, R2, moto) through boto3.

`TUNEHOUSE_BLOB_URL=s3://bucket/prefix`; the endpoint, region and credentials come from boto3's own
standard variables (AWS_ENDPOINT_URL, AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, or
a profile / instance role), so nothing here duplicates them.

Writes are multipart uploads of `blob_part_bytes` parts: an upload holds at most one part in memory
and the object appears only when the upload completes (S3's own atomic commit). A local file
(a checkpoint tar in the worker's scratch dir) goes through boto3's managed transfer, read from disk
part by part. Reads stream the object's body in chunks.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from service.storage.base import CHUNK_BYTES, BlobStore, BlobStoreUnavailable, BlobWriter

log = logging.getLogger("tunehouse.storage")

# S3 answers a missing object with these codes (HEAD has no body, so only its status: 404)
_MISSING = {"NoSuchKey", "404", "NotFound"}
# S3's smallest part but the last (5 MiB); a larger part size means fewer requests for a checkpoint
MIN_PART_BYTES = 5 * 1024 * 1024


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix` -> ("bucket", "some/prefix").

    >>> parse_s3_url("s3://th-blobs/prod/")
    ('th-blobs', 'prod')
    >>> parse_s3_url("s3://th-blobs")
    ('th-blobs', '')
    """
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ValueError(f"TUNEHOUSE_BLOB_URL must look like s3://bucket/prefix, not {url!r}")
    return parts.netloc, parts.path.strip("/")


@contextmanager
def _translated(key: str) -> Iterator[None]:
    """boto3's errors as the store's: a missing object is FileNotFoundError, anything else the store
    failing to answer (connection, timeout, 5xx, no such bucket, access denied) is BlobStoreUnavailable."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in _MISSING:
            raise FileNotFoundError(f"no blob {key!r}") from exc
        raise BlobStoreUnavailable(f"{code or 'error'} on {key!r}") from exc
    except (BotoCoreError, Boto3Error) as exc:
        raise BlobStoreUnavailable(type(exc).__name__) from exc


class S3BlobStore(BlobStore):
    def __init__(self, url: str, *, part_bytes: int, client: Any | None = None) -> None:
        self.bucket, self.prefix = parse_s3_url(url)
        self.part_bytes = part_bytes
        self._client = client

    @property
    def client(self) -> Any:
        # created on first use: a process that never touches a blob never builds a boto3 session
        if self._client is None:
            import boto3
            from botocore.config import Config

            # a few quick retries for a blip; the worker's own retry (worker/outage.py) rides out
            # longer outages, and the API answers 503 instead of holding a request for minutes
            config = Config(
                retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5, read_timeout=60
            )
            self._client = boto3.session.Session().client("s3", config=config)
        return self._client

    def object_key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def writer(self, key: str) -> S3BlobWriter:
        return S3BlobWriter(self, key)

    def open(self, key: str) -> BinaryIO:
        with _translated(key):
            body = self.client.get_object(Bucket=self.bucket, Key=self.object_key(key))["Body"]
        return io.BufferedReader(_BodyReader(body, key), CHUNK_BYTES)

    def size(self, key: str) -> int:
        with _translated(key):
            head = self.client.head_object(Bucket=self.bucket, Key=self.object_key(key))
        return int(head["ContentLength"])

    def delete(self, key: str) -> None:
        with _translated(key):
            self.client.delete_object(Bucket=self.bucket, Key=self.object_key(key))

    def put_file(self, key: str, source: Path) -> int:
        from boto3.s3.transfer import TransferConfig

        # boto3's managed transfer reads the file part by part (and sends parts in parallel)
        config = TransferConfig(multipart_threshold=self.part_bytes, multipart_chunksize=self.part_bytes)
        with _translated(key):
            self.client.upload_file(str(source), self.bucket, self.object_key(key), Config=config)
        return source.stat().st_size


class S3BlobWriter(BlobWriter):
    """A streamed multipart upload. The multipart upload starts only once a full part is buffered:
    a small blob (most datasets) is one PUT; nothing is visible before `commit`."""

    def __init__(self, store: S3BlobStore, key: str) -> None:
        self.store, self.key, self.object_key = store, key, store.object_key(key)
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []

    def _send_part(self, data: bytes) -> None:
        client = self.store.client
        with _translated(self.key):
            if self._upload_id is None:
                created = client.create_multipart_upload(Bucket=self.store.bucket, Key=self.object_key)
                self._upload_id = str(created["UploadId"])
            number = len(self._parts) + 1
            sent = client.upload_part(
                Bucket=self.store.bucket,
                Key=self.object_key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=data,
            )
        self._parts.append({"PartNumber": number, "ETag": sent["ETag"]})

    def write(self, data: bytes) -> None:
        self._buffer += data
        size = self.store.part_bytes
        while len(self._buffer) >= size:
            self._send_part(bytes(self._buffer[:size]))
            del self._buffer[:size]

    def commit(self) -> None:
        client, bucket = self.store.client, self.store.bucket
        if self._upload_id is None:
            with _translated(self.key):
                client.put_object(Bucket=bucket, Key=self.object_key, Body=bytes(self._buffer))
            return
        if self._buffer:
            self._send_part(bytes(self._buffer))
            self._buffer.clear()
        with _translated(self.key):
            client.complete_multipart_upload(
                Bucket=bucket,
                Key=self.object_key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": self._parts},
            )

    def abort(self) -> None:
        self._buffer.clear()
        if self._upload_id is None:
            return
        try:
            self.store.client.abort_multipart_upload(
                Bucket=self.store.bucket, Key=self.object_key, UploadId=self._upload_id
            )
        except Exception as exc:  # the store is down: the bucket's AbortIncompleteMultipartUpload rule
            # (docs/deploy.md) reclaims the parts; the blob itself was never visible
            log.warning("could not abort the upload of %s: %s", self.key, exc)


class _BodyReader(io.RawIOBase):
    """boto3's streaming body as a raw file (so BufferedReader gives `read`, lines and `readinto`),
    with a connection cut mid-read reported as the store being unavailable, not as a damaged blob."""

    def __init__(self, body: Any, key: str) -> None:
        self._body, self._key = body, key

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        with _translated(self._key):
            data = self._body.read(len(view))
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()
