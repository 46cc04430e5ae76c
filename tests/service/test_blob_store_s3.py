"""The S3 blob store against a real S3-compatible server (moto_server in a subprocess, tests/s3_server.py):
streamed multipart writes that appear only on commit, streamed reads, aborts that leave nothing, a
missing key as FileNotFoundError, an unreachable store as BlobStoreUnavailable — and, through a real
uvicorn API, uploads and downloads on S3 and a 503 with Retry-After while the store is down."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.storage import BlobStoreUnavailable, S3BlobStore
from tests.conftest import _stop, free_port, new_key, start_server
from tests.helpers import chat_rows, jsonl, stored_counts, tenant_of, upload
from tests.s3_server import S3Server, start_s3_server

BUCKET = "tunehouse-unit"
PART = 5 * 1024 * 1024  # S3's (and moto's) smallest part


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    server = start_s3_server()
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    server.stop()


def _store(s3: S3Server, prefix: str = "unit") -> S3BlobStore:
    return S3BlobStore(f"s3://{BUCKET}/{prefix}", part_bytes=PART, client=s3.client())


def _uploads_in_progress(s3: S3Server) -> list[Any]:
    return list(s3.client().list_multipart_uploads(Bucket=BUCKET).get("Uploads", []))


def _lines(n_bytes: int) -> bytes:
    line = b'{"text": "' + b"x" * 90 + b'"}\n'
    return line * (n_bytes // len(line) + 1)


def test_streamed_multipart_write_appears_only_on_commit(s3: S3Server) -> None:
    store = _store(s3)
    data = _lines(11 * 1024 * 1024)  # two full parts and a short last one
    writer = store.writer("files/t/big.jsonl")
    most_buffered = 0
    for start in range(0, len(data), 64 * 1024):
        writer.write(data[start : start + 64 * 1024])
        most_buffered = max(most_buffered, len(writer._buffer))
    assert most_buffered < PART, "the writer holds at most one part in memory"
    assert len(_uploads_in_progress(s3)) == 1
    with pytest.raises(FileNotFoundError):  # two parts sent, nothing visible before commit
        store.size("files/t/big.jsonl")
    writer.commit()

    head = s3.client().head_object(Bucket=BUCKET, Key="unit/files/t/big.jsonl")
    assert head["ETag"].strip('"').endswith("-3")  # a multipart object of three parts
    assert store.size("files/t/big.jsonl") == len(data)
    with store.open("files/t/big.jsonl") as fh:
        first = fh.readline()
        rest = fh.read()
    assert first + rest == data and first.endswith(b"\n") and len(first) < 200
    assert b"".join(store.iter_bytes("files/t/big.jsonl", 1024 * 1024)) == data
    assert _uploads_in_progress(s3) == []


def test_small_blob_is_one_put_and_delete_is_idempotent(s3: S3Server) -> None:
    store = _store(s3)
    with store.writer("files/t/small.jsonl") as writer:
        writer.write(b'{"text": "hi"}\n')
    head = s3.client().head_object(Bucket=BUCKET, Key="unit/files/t/small.jsonl")
    assert "-" not in head["ETag"]
    assert _uploads_in_progress(s3) == []
    store.delete("files/t/small.jsonl")
    store.delete("files/t/small.jsonl")
    with pytest.raises(FileNotFoundError):
        store.open("files/t/small.jsonl")
    with pytest.raises(FileNotFoundError):
        store.size("files/t/small.jsonl")


def test_abort_after_a_sent_part_leaves_nothing(s3: S3Server) -> None:
    store = _store(s3)
    with pytest.raises(RuntimeError), store.writer("files/t/aborted.jsonl") as writer:
        writer.write(b"x" * (PART + 10))  # one part already on the server
        assert len(_uploads_in_progress(s3)) == 1
        raise RuntimeError("the upload failed validation")
    assert _uploads_in_progress(s3) == []
    with pytest.raises(FileNotFoundError):
        store.size("files/t/aborted.jsonl")


def test_put_file_streams_a_checkpoint_in_parts(s3: S3Server, tmp_path: Path) -> None:
    store = _store(s3, prefix="deploy/b")
    source = tmp_path / "model.tar"
    source.write_bytes(os.urandom(PART * 2 + 123))
    assert store.put_file("checkpoints/t/j/c-model.tar", source) == source.stat().st_size
    head = s3.client().head_object(Bucket=BUCKET, Key="deploy/b/checkpoints/t/j/c-model.tar")
    assert head["ETag"].strip('"').endswith("-3")
    out = io.BytesIO()
    store.copy_to("checkpoints/t/j/c-model.tar", out)
    assert out.getvalue() == source.read_bytes()


def test_unreachable_store_is_unavailable_not_missing(tmp_path: Path) -> None:
    import boto3

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = boto3.session.Session().client(
        "s3", endpoint_url=dead, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    store = S3BlobStore(f"s3://{BUCKET}/x", part_bytes=PART, client=client)
    source = tmp_path / "f"
    source.write_bytes(b"abc")
    for call in (
        lambda: store.open("k"),
        lambda: store.size("k"),
        lambda: store.delete("k"),
        lambda: store.put_file("k", source),
        lambda: store.writer("k").commit(),
    ):
        with pytest.raises(BlobStoreUnavailable) as caught:
            call()
        assert caught.value.status_code == 503 and caught.value.code == "blob_store_unavailable"
    store.writer("k").abort()  # never raises


# --- through the API (one uvicorn server on the module's store; the last test stops the store) ----------


@pytest.fixture(scope="module")
def api(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    data_dir = tmp_path_factory.mktemp("s3-api") / "data"
    url, server = start_server(
        {
            **s3.env(),
            "TUNEHOUSE_BLOB_URL": f"s3://{BUCKET}/api",
            "TUNEHOUSE_BLOB_PART_BYTES": str(PART),
            "TUNEHOUSE_MAX_UPLOAD_BYTES": str(16 * 1024 * 1024),
            # a data dir of its own: the test shows nothing lands there
            "TUNEHOUSE_DATA_DIR": str(data_dir),
        }
    )
    yield url, data_dir
    _stop(server)


def _client(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_upload_and_download_through_the_api_live_on_s3(s3: S3Server, api: tuple[str, Path]) -> None:
    url, data_dir = api
    key = new_key()
    with _client(url, key) as client:
        data = jsonl(chat_rows(40))
        created = upload(client, data)
        assert created.status_code == 200, created.text
        file_id = created.json()["id"]
        objects = s3.client().list_objects_v2(Bucket=BUCKET, Prefix="api/files/")["Contents"]
        assert [o["Key"] for o in objects] == [f"api/files/{tenant_of(key)}/{file_id}.jsonl"]
        content = client.get(f"/v1/files/{file_id}/content")
        assert content.status_code == 200 and content.content == data
        assert content.headers["content-length"] == str(len(data))

        # a file rejected on its last line, after a whole part went to S3: nothing is kept
        before = stored_counts(tenant_of(key))
        bad = _lines(6 * 1024 * 1024) + b'{"text": 1}\n'
        rejected = upload(client, bad)
        assert rejected.status_code == 400, rejected.text
        assert "line" in rejected.json()["error"]["message"]
        assert stored_counts(tenant_of(key)) == before
        assert _uploads_in_progress(s3) == []
        assert len(s3.client().list_objects_v2(Bucket=BUCKET, Prefix="api/files/")["Contents"]) == 1

        assert client.delete(f"/v1/files/{file_id}").status_code == 200
        assert "Contents" not in s3.client().list_objects_v2(Bucket=BUCKET, Prefix="api/files/")
    assert not (data_dir / "blobs").exists()


def test_bucketless_url_is_refused_at_startup() -> None:
    from pydantic import ValidationError

    from service.config import Settings

    with pytest.raises(ValidationError, match="names no bucket"):
        Settings(blob_url="s3:///prefix")
    assert Settings(blob_url="s3://b/p").blob_url == "s3://b/p"


def test_store_down_is_a_503_with_retry_after(s3: S3Server, api: tuple[str, Path]) -> None:
    """Last in the module: it stops the module's S3 server (by its pid)."""
    url, _ = api
    key = new_key()
    with _client(url, key) as client:
        file_id = upload(client, jsonl(chat_rows(4))).json()["id"]
        s3.stop()
        before = stored_counts(tenant_of(key))
        for response in (
            upload(client, jsonl(chat_rows(4))),
            client.get(f"/v1/files/{file_id}/content"),
        ):
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "2"
            error = response.json()["error"]
            assert error["code"] == "blob_store_unavailable" and "blob store" in error["message"]
        assert stored_counts(tenant_of(key)) == before  # the refused upload left no row
