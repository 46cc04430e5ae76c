"""The whole path with blobs on S3: a real moto_server (tests/s3_server.py), uvicorn and a Celery worker
whose only shared storage is that server (each has a data dir of its own, and nothing lands in it).

upload -> SFT job -> checkpoints uploaded in parts from the worker's scratch dir -> download through
the API; pause, then resume in a fresh trainer process that downloads its checkpoint from S3; and a
worker that finds the store down retries, says so in the job's events, and fails the job as a system
fault. The test prints its timings (`-s` shows them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import _stop, redis_db, start_server
from tests.helpers import all_pages, chat_rows, trainer_pid, upload_ok, wait_for
from tests.s3_server import S3Server, start_s3_server

BUCKET = "tunehouse-e2e"
PREFIX = "deploy-a"
# small parts, on both sides, so the tiny model's checkpoints (about 0.5 MB) go as multipart uploads
PART = 128 * 1024
BROKER = redis_db(4)
OUTAGE_TOLERANCE = 3.0


@dataclass
class S3Stack:
    url: str
    s3: S3Server
    api_dir: Path
    worker_dir: Path


@pytest.fixture(scope="module")
def s3_stack() -> Iterator[S3Stack]:
    import redis

    redis.Redis.from_url(BROKER).flushdb()
    started = time.monotonic()
    s3 = start_s3_server(part_min_bytes=PART)
    s3.client().create_bucket(Bucket=BUCKET)
    api_dir, worker_dir = (Path(tempfile.mkdtemp(prefix=f"tunehouse-s3-{who}-")) for who in ("api", "worker"))
    env = {
        **s3.env(),
        "TUNEHOUSE_BROKER_URL": BROKER,
        # a queue of its own: workers claim any queued job of their queue in the shared database, and
        # the session stack's worker (local blobs) cannot read these jobs' files
        "TUNEHOUSE_JOB_QUEUE": "tunehouse-s3",
        "TUNEHOUSE_BLOB_URL": f"s3://{BUCKET}/{PREFIX}",
        "TUNEHOUSE_BLOB_PART_BYTES": str(PART),
        "TUNEHOUSE_BLOB_OUTAGE_TOLERANCE_SECONDS": str(OUTAGE_TOLERANCE),
    }
    url, server = start_server({**env, "TUNEHOUSE_DATA_DIR": str(api_dir)})
    worker = subprocess.Popen(
        [sys.executable, "-m", "tunehouse.cli", "worker", "--loglevel", "warning"],
        env={**os.environ, **env, "TUNEHOUSE_DATA_DIR": str(worker_dir)},
    )
    print(f"\n[s3 e2e] moto + bucket + API up in {time.monotonic() - started:.1f} s")
    yield S3Stack(url=url, s3=s3, api_dir=api_dir, worker_dir=worker_dir)
    _stop(worker)
    _stop(server)
    s3.stop()


@pytest.fixture
def client(s3_stack: S3Stack, api_key: str) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=s3_stack.url, headers=headers, timeout=60) as c:
        yield c


def _job(client: httpx.Client, file_id: str, **hp: float) -> str:
    created = client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": "tunehouse/tiny-llama",
            "training_file": file_id,
            "seed": 5,
            "method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 4, **hp}}},
        },
    )
    assert created.status_code == 200, created.text
    return str(created.json()["id"])


def _object(s3_stack: S3Stack, blob_key: str) -> dict[str, object]:
    return dict(s3_stack.s3.client().head_object(Bucket=BUCKET, Key=f"{PREFIX}/{blob_key}"))


def _local_blobs(s3_stack: S3Stack) -> list[Path]:
    return [p for d in (s3_stack.api_dir, s3_stack.worker_dir) for p in d.rglob("*.tar") if p.is_file()] + [
        p for d in (s3_stack.api_dir, s3_stack.worker_dir) for p in (d / "blobs").rglob("*") if p.is_file()
    ]


def test_upload_job_checkpoint_resume_download_on_s3(s3_stack: S3Stack, client: httpx.Client) -> None:
    from service.db import session_scope
    from service.models import Checkpoint, File

    t0 = time.monotonic()
    file_id = upload_ok(client, chat_rows(16))
    with session_scope() as session:
        file_row = session.get(File, file_id)
        assert file_row is not None
        file_key = file_row.blob_key
    assert _object(s3_stack, file_key)["ContentLength"] == client.get(f"/v1/files/{file_id}").json()["bytes"]
    t_upload = time.monotonic() - t0

    # paused as soon as its trainer runs (at step 0: the trainer asks before each step): that
    # checkpoint goes to S3, and the resumed run (a fresh trainer process with an empty scratch dir) can
    # only get it back from there. The trainer is held (SIGSTOP) while the pause is asked, so a fast
    # machine cannot train all 8 steps first (CI once did: the pause came too late).
    job_id = _job(client, file_id, n_epochs=2, save_steps=4)
    deadline = time.monotonic() + 180
    while (pid := trainer_pid(job_id)) is None:
        assert time.monotonic() < deadline, "the job's trainer did not start"
        time.sleep(0.05)
    t_started = time.monotonic() - t0
    os.kill(pid, signal.SIGSTOP)
    try:
        assert client.post(f"/v1/fine_tuning/jobs/{job_id}/pause").status_code == 200
    finally:
        os.kill(pid, signal.SIGCONT)
    paused = wait_for(client, job_id, statuses=("paused", "succeeded", "failed"))
    assert paused["status"] == "paused", paused
    t_paused = time.monotonic() - t0
    assert client.post(f"/v1/fine_tuning/jobs/{job_id}/resume").status_code == 200
    job = wait_for(client, job_id)
    assert job["status"] == "succeeded", job
    t_done = time.monotonic() - t0

    events = [e["message"] for e in all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/events")]
    resumed = [m for m in events if m.startswith("Resuming from the checkpoint at step")]
    assert len(resumed) == 1, events
    metrics = all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/metrics")
    assert [m["step"] for m in metrics] == list(range(1, job["total_steps"] + 1))

    checkpoints = all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/checkpoints")
    assert max(c["step_number"] for c in checkpoints) == job["total_steps"] == 8
    final = next(c for c in checkpoints if c["is_final"])
    with session_scope() as session:
        row = session.get(Checkpoint, final["id"])
        assert row is not None
        final_key = row.blob_key
    head = _object(s3_stack, final_key)
    assert head["ContentLength"] == final["bytes"] > PART
    # a multipart upload (boto3's managed transfer sends parts of at least 5 MiB, so one part here)
    assert "-" in str(head["ETag"])

    t1 = time.monotonic()
    with client.stream("GET", f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{final['id']}/content") as got:
        assert got.status_code == 200
        body = b"".join(got.iter_bytes())
    t_download = time.monotonic() - t1
    stored = s3_stack.s3.client().get_object(Bucket=BUCKET, Key=f"{PREFIX}/{final_key}")["Body"].read()
    assert body == stored and len(body) == final["bytes"]
    assert _local_blobs(s3_stack) == []  # API and worker share nothing but the S3 server
    print(
        f"\n[s3 e2e] upload {t_upload:.1f} s; training from {t_started:.1f} s; paused at {t_paused:.1f} s; "
        f"{resumed[0].lower()}, succeeded at {t_done:.1f} s (8 steps); final checkpoint "
        f"({final['bytes'] / 1e6:.2f} MB) downloaded through the API in {t_download:.2f} s"
    )


def test_store_down_in_the_worker_is_retried_then_a_system_fault(
    s3_stack: S3Stack, client: httpx.Client
) -> None:
    """Last in the module: it stops the module's S3 server (by its pid)."""
    file_id = upload_ok(client, chat_rows(8))
    s3_stack.s3.stop()
    job_id = _job(client, file_id, n_epochs=1)
    job = wait_for(client, job_id)
    assert job["status"] == "failed", job
    assert job["error"]["code"] == "blob_store_unavailable" and job["error"]["fault"] == "system"
    events = [e["message"] for e in all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/events")]
    expected = (
        "The blob store is unavailable (EndpointConnectionError); "
        f"the worker retries for up to {OUTAGE_TOLERANCE:g} s"
    )
    assert expected in events, events
