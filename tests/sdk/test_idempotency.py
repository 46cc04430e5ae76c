"""Creates carry an `Idempotency-Key`: one per logical call, the same on each automatic retry of that call,
the caller's own when given. Against a real HTTP server of the test's own that records every request and
fails or stalls the first tries, so the check does not depend on the API honouring the key."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

import tunehouse

JOB = {
    "id": "ftjob-1",
    "object": "fine_tuning.job",
    "created_at": 1,
    "model": "m",
    "organization_id": "org",
    "seed": 1,
    "status": "queued",
    "training_file": "file-1",
    "method": {"type": "supervised"},
}
FILE = {
    "id": "file-1",
    "object": "file",
    "bytes": 3,
    "created_at": 1,
    "filename": "f",
    "purpose": "fine-tune",
    "status": "processed",
}
ERROR = {"error": {"message": "scripted", "type": "server_error", "param": None, "code": None}}


@dataclass
class Recorder:
    """What the server answers to each POST in turn (`503` or `stall`, then 200 by default), and the
    Idempotency-Key (None when absent) of every POST it saw."""

    script: list[str] = field(default_factory=list)
    keys: list[str | None] = field(default_factory=list)


@pytest.fixture
def recorder() -> Iterator[tuple[str, Recorder]]:
    rec = Recorder()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            rec.keys.append(self.headers.get("Idempotency-Key"))
            step = rec.script.pop(0) if rec.script else "ok"
            if step == "stall":
                time.sleep(1.5)  # past the client's timeout: it gives up on this try and retries
            status = 503 if step == "503" else 200
            body = json.dumps(ERROR if status != 200 else FILE if self.path == "/v1/files" else JOB).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("retry-after", "0")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = False
        block_on_close = True  # each handler closes its socket before the test ends

    Handler.timeout = 10
    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", rec
    finally:
        server.shutdown()
        server.server_close()


def test_a_retried_job_create_sends_the_same_key(recorder: tuple[str, Recorder]) -> None:
    url, rec = recorder
    rec.script = ["503", "503"]
    with tunehouse.Client(base_url=url, api_key="k", max_retries=2) as client:
        job = client.fine_tuning.jobs.create(model="m", training_file="file-1")
        assert job.id == "ftjob-1"
        assert len(rec.keys) == 3  # two failures, then the answer
        first = rec.keys[0]
        assert first is not None and first.startswith("tunehouse-") and len(first) > len("tunehouse-") + 30
        assert rec.keys == [first] * 3

        client.fine_tuning.jobs.create(model="m", training_file="file-1")  # another logical call
        assert rec.keys[3] not in (None, first)


def test_a_timed_out_create_is_retried_with_the_same_key(recorder: tuple[str, Recorder]) -> None:
    # the case of issue 46: the server committed the job but answered too late for the client
    url, rec = recorder
    rec.script = ["stall"]
    with tunehouse.Client(base_url=url, api_key="k", max_retries=1) as client:
        client.fine_tuning.jobs.create(model="m", training_file="file-1", timeout=0.5)
    assert len(rec.keys) == 2 and rec.keys[0] == rec.keys[1] is not None


def test_the_callers_own_key_is_sent_on_every_try(recorder: tuple[str, Recorder]) -> None:
    url, rec = recorder
    rec.script = ["503"]
    with tunehouse.Client(base_url=url, api_key="k", max_retries=2) as client:
        client.fine_tuning.jobs.create(model="m", training_file="file-1", idempotency_key="order-42")
        client.fine_tuning.jobs.create(model="m", training_file="file-1", idempotency_key="order-42")
    assert rec.keys == ["order-42"] * 3


def test_the_async_client_keys_its_creates_the_same_way(recorder: tuple[str, Recorder]) -> None:
    url, rec = recorder
    rec.script = ["503"]

    async def run() -> None:
        async with tunehouse.AsyncClient(base_url=url, api_key="k", max_retries=2) as client:
            await client.fine_tuning.jobs.create(model="m", training_file="file-1")
            await client.fine_tuning.jobs.create(model="m", training_file="file-1")

    asyncio.run(run())
    assert len(rec.keys) == 3 and rec.keys[0] == rec.keys[1] != rec.keys[2]
    assert all(k and k.startswith("tunehouse-") for k in rec.keys)


def test_an_upload_sends_a_key_but_is_not_repeated(recorder: tuple[str, Recorder]) -> None:
    # the server does not deduplicate uploads: a repeat would store the file twice
    url, rec = recorder
    rec.script = ["503"]
    with tunehouse.Client(base_url=url, api_key="k", max_retries=2) as client:
        with pytest.raises(tunehouse.InternalServerError):
            client.files.create(file=b'{"text": "x"}\n')
        assert len(rec.keys) == 1 and (rec.keys[0] or "").startswith("tunehouse-")
        client.files.create(file=b'{"text": "x"}\n')
    assert rec.keys[1] not in (None, rec.keys[0])
