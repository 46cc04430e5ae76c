"""The SDK against live servers: typed objects, self-paging lists, typed errors with request ids,
retries, streaming, wait and checkpoint download."""

from __future__ import annotations

import asyncio
import http.server
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import tunehouse
from tests.conftest import Stack, free_port
from tests.helpers import chat_rows, jsonl

MODEL = "tunehouse/tiny-llama"


@pytest.fixture
def sdk(api_url: str, api_key: str) -> Iterator[tunehouse.Client]:
    with tunehouse.Client(base_url=api_url, api_key=api_key) as client:
        yield client


@pytest.fixture
def stack_sdk(stack: Stack, api_key: str) -> Iterator[tunehouse.Client]:
    with tunehouse.Client(base_url=stack.url, api_key=api_key) as client:
        yield client


def test_sdk_imports_no_torch_or_fastapi() -> None:
    import subprocess
    import sys

    code = (
        "import sys, tunehouse, tunehouse.cli; "
        "print(sorted(m for m in ('torch', 'fastapi', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_config_from_environment(api_url: str, api_key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNEHOUSE_BASE_URL", api_url + "/v1")
    monkeypatch.setenv("TUNEHOUSE_API_KEY", api_key)
    with tunehouse.Client() as client:
        assert client.files.list().data == []
    monkeypatch.delenv("TUNEHOUSE_API_KEY")
    with pytest.raises(ValueError, match="TUNEHOUSE_API_KEY"):
        tunehouse.Client()


def test_files_and_jobs_round_trip(sdk: tunehouse.Client, tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(jsonl(chat_rows(12)))
    f = sdk.files.create(file=path)
    assert isinstance(f, tunehouse.FileObject) and f.format == "chat" and f.line_count == 12
    assert sdk.files.retrieve(f.id) == f
    assert sdk.files.content(f.id) == path.read_bytes()

    ids = [
        sdk.fine_tuning.jobs.create(model=MODEL, training_file=f.id, metadata={"n": str(i)}).id
        for i in range(5)
    ]
    page = sdk.fine_tuning.jobs.list(limit=2)
    assert len(page.data) == 2 and page.has_more
    assert [j.id for j in page] == ids[::-1]  # iterating fetches the next pages
    assert [j.id for j in sdk.fine_tuning.jobs.list(metadata={"n": "3"})] == [ids[3]]

    job = sdk.fine_tuning.jobs.retrieve(ids[0])
    assert isinstance(job, tunehouse.FineTuningJob) and job.status == "queued" and not job.done
    positions = [sdk.fine_tuning.jobs.retrieve(i).queue_position for i in ids]
    assert None not in positions and positions == sorted(set(positions)), positions  # FIFO in a tenant
    events = list(sdk.fine_tuning.jobs.list_events(job.id, limit=1))
    assert len(events) == 2 and all(isinstance(e, tunehouse.JobEvent) for e in events)
    cancelled = sdk.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.queue_position is None
    assert sdk.files.delete(f.id).deleted


def test_typed_errors_carry_status_param_and_request_id(sdk: tunehouse.Client, api_url: str) -> None:
    with pytest.raises(tunehouse.NotFoundError) as not_found:
        sdk.fine_tuning.jobs.retrieve("ftjob-missing")
    assert not_found.value.status_code == 404 and not_found.value.request_id
    assert not_found.value.request_id in str(not_found.value)

    f = sdk.files.create(file=jsonl(chat_rows(2)))
    with pytest.raises(tunehouse.BadRequestError) as bad:
        sdk.fine_tuning.jobs.create(model="nope", training_file=f.id)
    assert bad.value.param == "model"
    with pytest.raises(tunehouse.BadRequestError) as bad:
        sdk.fine_tuning.jobs.create(model=MODEL, training_file=f.id, integrations=[{"type": "wandb"}])
    assert bad.value.param == "integrations[0]"

    wandb = [{"type": "wandb", "wandb": {"project": "p"}}]
    job = sdk.fine_tuning.jobs.create(model=MODEL, training_file=f.id, integrations=wandb)
    assert job.integrations == wandb
    assert sdk.fine_tuning.jobs.pause(job.id).status == "paused"  # no worker on this server: still queued
    with pytest.raises(tunehouse.ConflictError) as pause:
        sdk.fine_tuning.jobs.pause(job.id)
    assert pause.value.code == "job_not_pausable" and pause.value.param == "fine_tuning_job_id"
    assert sdk.fine_tuning.jobs.resume(job.id).status == "queued"
    sdk.fine_tuning.jobs.cancel(job.id)
    with pytest.raises(tunehouse.ConflictError):
        sdk.fine_tuning.jobs.cancel(job.id)

    with (
        tunehouse.Client(base_url=api_url, api_key="th-bad-key") as bad_client,
        pytest.raises(tunehouse.AuthenticationError),
    ):
        bad_client.files.list()


class _Flaky(http.server.BaseHTTPRequestHandler):
    """A real HTTP server that fails the first N GETs with 503, to observe the SDK's retries."""

    failures_left = 0
    hits = 0

    def do_GET(self) -> None:
        type(self).hits += 1
        if type(self).failures_left > 0:
            type(self).failures_left -= 1
            self.send_response(503)
            self.send_header("retry-after", "0")
            body = b'{"error": {"message": "busy", "type": "server_error", "param": null, "code": null}}'
        else:
            self.send_response(200)
            body = b'{"object": "list", "data": [], "has_more": false}'
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_retries_on_5xx_then_gives_up() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        _Flaky.failures_left, _Flaky.hits = 2, 0
        with tunehouse.Client(base_url=url, api_key="k", max_retries=2) as client:
            assert client.files.list().data == []
        assert _Flaky.hits == 3
        _Flaky.failures_left, _Flaky.hits = 5, 0
        with (
            tunehouse.Client(base_url=url, api_key="k", max_retries=1) as client,
            pytest.raises(tunehouse.InternalServerError),
        ):
            client.files.list()
        assert _Flaky.hits == 2
    finally:
        server.shutdown()
        server.server_close()


def test_connection_error_is_typed() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with (
        tunehouse.Client(base_url=url, api_key="k", max_retries=0) as client,
        pytest.raises(tunehouse.APIConnectionError),
    ):
        client.files.list()


def test_stream_wait_metrics_and_download(stack_sdk: tunehouse.Client, api_key: str, tmp_path: Path) -> None:
    f = stack_sdk.files.create(file=jsonl(chat_rows(16)))
    job = stack_sdk.fine_tuning.jobs.create(
        model=MODEL,
        training_file=f.id,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 4}}},
    )
    seen: list[tunehouse.StreamItem] = []
    done = stack_sdk.fine_tuning.jobs.wait(job.id, timeout=240, on_item=seen.append)
    assert done.status == "succeeded"
    metric_steps = [i.step for i in seen if isinstance(i, tunehouse.MetricRow)]
    assert metric_steps == list(range(1, 9))
    assert isinstance(seen[-1], tunehouse.StreamEnd) and seen[-1].status == "succeeded"
    assert any(isinstance(i, tunehouse.JobEvent) and i.message.startswith("Training started") for i in seen)

    rows = list(stack_sdk.fine_tuning.jobs.metrics(job.id, limit=3))
    assert [r.step for r in rows] == list(range(1, 9)) and rows[0].value("loss") is not None

    final = next(c for c in stack_sdk.fine_tuning.jobs.checkpoints.list(job.id) if c.is_final)
    progress: list[tuple[int, int | None]] = []
    path = stack_sdk.fine_tuning.jobs.checkpoints.download(
        job.id, final.id, tmp_path / "m.tar", progress=lambda d, t: progress.append((d, t))
    )
    assert path.stat().st_size == final.bytes and progress[-1] == (final.bytes, final.bytes)
    with tarfile.open(path) as tar:
        assert "model.safetensors" in tar.getnames()

    async def async_download() -> Path:
        async with tunehouse.AsyncClient(base_url=stack_sdk.base_url, api_key=api_key) as client:
            return await client.fine_tuning.jobs.checkpoints.download(job.id, final.id, tmp_path / "a.tar")

    assert asyncio.run(async_download()).read_bytes() == path.read_bytes()


def test_async_client(api_url: str, api_key: str) -> None:
    async def flow() -> None:
        async with tunehouse.AsyncClient(base_url=api_url, api_key=api_key) as client:
            f = await client.files.create(file=jsonl(chat_rows(3)))
            job = await client.fine_tuning.jobs.create(model=MODEL, training_file=f.id)
            assert (await client.fine_tuning.jobs.retrieve(job.id)).status == "queued"
            page = await client.fine_tuning.jobs.list(limit=1)
            assert [j.id async for j in page] == [job.id]
            assert (await client.fine_tuning.jobs.pause(job.id)).status == "paused"
            with pytest.raises(tunehouse.ConflictError):
                await client.fine_tuning.jobs.resume(job.id) and await client.fine_tuning.jobs.resume(job.id)
            assert (await client.fine_tuning.jobs.pause(job.id)).status == "paused"
            assert (await client.fine_tuning.jobs.cancel(job.id)).status == "cancelled"
            assert [e.message async for e in await client.fine_tuning.jobs.list_events(job.id, limit=1)][-1]
            with pytest.raises(tunehouse.NotFoundError):
                await client.files.retrieve("file-missing")

    asyncio.run(flow())
