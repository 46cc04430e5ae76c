"""`tunehouse up` on the embedded default (SQLite, filesystem broker, local blobs): the demo job trains."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tunehouse.embedded import EmbeddedError, watch_job


def test_tunehouse_up_runs_the_demo_job(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEHOUSE_")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tunehouse.cli",
            "up",
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "data"),
            # no Redis: the embedded paths without one (replies through the data dir, streams polling
            # the DB) stay covered here; tests/tinker/test_embedded.py runs `make run` with its Redis
            "--no-tinker",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        # generous: four processes (API, worker, trainer, inference worker) start on a shared 2-core box
        deadline = time.monotonic() + 420
        while not any(line.startswith("tunehouse is running") for line in lines):
            assert time.monotonic() < deadline, "".join(lines)
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
        output = "".join(lines)
        assert re.search(r"demo: job ftjob-\S+ succeeded; model ft:tunehouse/tiny-llama:", output), output
        assert re.search(r"step\s+1\s+loss", output)
        assert "demo: asked the fine-tuned model 'What is the capital of France?'; it answers" in output
        key = re.search(r"API key: (\S+)", output)
        assert key is not None
        assert "Tinker API: off (--no-tinker)" in output
        assert f"  export TUNEHOUSE_API_KEY={key.group(1)}\n" in output

        headers = {"Authorization": f"Bearer {key.group(1)}"}
        jobs = httpx.get(f"http://127.0.0.1:{port}/v1/fine_tuning/jobs", headers=headers).json()["data"]
        # the inference worker streams back through the data dir (no Redis in the embedded default)
        streamed = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={
                "model": jobs[0]["fine_tuned_model"],
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
                "stream": True,
            },
            headers=headers,
            timeout=120,
        )
        assert streamed.status_code == 200, streamed.text
        assert streamed.text.startswith("data: {") and streamed.text.endswith("data: [DONE]\n\n")
        assert [j["status"] for j in jobs] == ["succeeded"]
        # no worker bound a remote-control queue: two workers binding it into one file at once could
        # read it empty and die (service/queue.py)
        assert not (tmp_path / "data" / "broker" / "celery.pidbox.exchange").exists()
        # a job's read (plain rows, read in a thread on SQLite) gives the job the list gives
        one = httpx.get(f"http://127.0.0.1:{port}/v1/fine_tuning/jobs/{jobs[0]['id']}", headers=headers)
        assert one.json() == jobs[0]
        metrics = httpx.get(
            f"http://127.0.0.1:{port}/v1/fine_tuning/jobs/{jobs[0]['id']}/metrics", headers=headers
        ).json()["data"]
        assert metrics[-1]["loss"] < metrics[0]["loss"]
        # the live stream works without Redis too (the API polls the DB)
        import tunehouse

        with tunehouse.Client(base_url=f"http://127.0.0.1:{port}", api_key=key.group(1)) as client:
            items = list(client.fine_tuning.jobs.stream(jobs[0]["id"]))
        assert isinstance(items[-1], tunehouse.StreamEnd) and items[-1].status == "succeeded"
        assert [i.step for i in items if isinstance(i, tunehouse.MetricRow)] == [m["step"] for m in metrics]
        # the embedded default really is embedded: SQLite file, filesystem broker, blob folder
        data = tmp_path / "data"
        assert (data / "tunehouse.sqlite").exists() and (data / "broker").is_dir()
        assert any((data / "blobs" / "checkpoints").rglob("*-model.tar"))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            proc.stdout.close()
    assert proc.returncode == 0


def test_up_refuses_a_busy_port(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEHOUSE_")}
        result = subprocess.run(
            [sys.executable, "-m", "tunehouse.cli", "up", "--port", str(port), "--data-dir", str(tmp_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2
    assert f"port {port}" in result.stderr and "Traceback" not in result.stderr


def test_the_demo_stops_waiting_when_a_worker_has_exited() -> None:
    """Watching the demo job, `tunehouse up` notices a worker that died (it used to wait forever for a job
    nobody would run) and says which process exited and how."""
    api = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    worker = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    worker.wait()
    try:
        with (
            httpx.Client(base_url="http://127.0.0.1:9") as client,  # never reached: it stops first
            pytest.raises(EmbeddedError, match="the training worker process exited with code 3"),
        ):
            watch_job(client, "ftjob-x", time.monotonic(), {"API": api, "training worker": worker})
    finally:
        api.kill()
        api.wait()
