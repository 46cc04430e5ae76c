"""API throughput: uvicorn on PostgreSQL under `wrk`, at 8, 50, 200 and 1,000 connections.

    make bench TRAINER_BENCH=--skip ARGS="-k api_throughput -s"   # needs `wrk` (Debian: apt-get install wrk)
    BENCH_API_WORKERS=2 make bench TRAINER_BENCH=--skip ARGS="-k api_throughput -s"   # two processes

Prints, for `GET /v1/fine_tuning/jobs/{id}` (the call a polling dashboard fleet makes): req/s, p50 and
p99 latency, non-2xx answers and socket errors, and the median and slowest `/healthz` seen while each load ran
(it must never wait on the database pool). Then the job creation rate (`POST /v1/fine_tuning/jobs` at 8
connections, broker with no worker), the read again at 50 connections with the jobs that row queued
(a queued job's position is its rank among them all), and the dispatch latency (POST -> `running` with
one idle worker).
wrk runs on the same host as the server (loopback only), so both share the CPU: compare figures taken
back to back on the same machine, not across machines. docs/benchmarks.md holds the latest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import IDLE, WORKER_BROKER, _stop, new_key, start_server
from tests.helpers import TERMINAL, chat_rows, trainer_pid, upload_ok, wait_for

CONNECTIONS = (8, 50, 200, 1000)
SECONDS = int(os.environ.get("BENCH_API_SECONDS", "10"))
WORKERS = int(os.environ.get("BENCH_API_WORKERS", "1"))  # uvicorn --workers (processes)
DISPATCH_JOBS = 3
MODEL = "tunehouse/tiny-llama"


@dataclass
class Load:
    connections: int
    rps: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int
    healthz_max_ms: float
    healthz_p50_ms: float = 0.0
    healthz_failures: int = 0

    def row(self) -> str:
        return (
            f"| {self.connections} | {self.rps:,.0f} | {self.p50_ms:.1f} | {self.p99_ms:.1f} | "
            f"{self.non_2xx} | {self.socket_errors} | "
            f"{self.healthz_p50_ms:.0f} / {self.healthz_max_ms:.0f} ({self.healthz_failures} failed) |"
        )


_UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}


def _ms(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
    return float(number) * _UNIT_MS[unit]


def _wrk(url: str, key: str, connections: int, seconds: int, script: Path | None = None) -> str:
    command = [
        "wrk",
        f"-t{min(2, connections)}",
        f"-c{connections}",
        f"-d{seconds}s",
        "--timeout",
        "20s",
        "--latency",
        "-H",
        f"Authorization: Bearer {key}",
    ]
    if script is not None:
        command += ["-s", str(script)]
    return subprocess.run([*command, url], check=True, capture_output=True, text=True).stdout


def _parse(out: str, connections: int, healthz_max_ms: float) -> Load:
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return Load(
        connections=connections,
        rps=float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),  # type: ignore[union-attr]
        p50_ms=_ms(re.search(r"\s50%\s+(\S+)", out).group(1)),  # type: ignore[union-attr]
        p99_ms=_ms(re.search(r"\s99%\s+(\S+)", out).group(1)),  # type: ignore[union-attr]
        non_2xx=int(non_2xx.group(1)) if non_2xx else 0,
        socket_errors=sum(int(n) for n in errors.groups()) if errors else 0,
        healthz_max_ms=healthz_max_ms,
    )


class HealthProbe:
    """Polls /healthz on its own connection while a load runs; keeps each answer's time."""

    def __init__(self, url: str) -> None:
        self.url = f"{url}/healthz"
        self.times: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.wait(0.25):
                started = time.perf_counter()
                try:
                    ok = client.get(self.url).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.failures += not ok
                self.times.append(time.perf_counter() - started)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def _drain(job_url: str, key: str) -> None:
    """Wait until the server has worked off what wrk left queued when it hung up (requests still
    admitted one by one after their client is gone), so each row starts from an idle server."""
    deadline = time.monotonic() + 120
    with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            assert client.get(job_url).status_code == 200
            if time.perf_counter() - started < 0.2:
                return
            time.sleep(0.5)


@pytest.fixture
def wrk() -> None:
    assert shutil.which("wrk"), "this benchmark drives the server with wrk: apt-get install wrk"


@pytest.fixture
def idle_api() -> Iterator[str]:
    # its own queue too: the hundreds of jobs the creation-rate row leaves queued must not sit in the
    # queue the dispatch-latency worker claims from (it would run them first: they are older)
    url, server = start_server(IDLE, workers=WORKERS)
    yield url
    _stop(server)


def _create_body(file_id: str) -> str:
    return json.dumps({"model": MODEL, "training_file": file_id, "hyperparameters": {"n_epochs": 1}})


@pytest.mark.slow
@pytest.mark.usefixtures("wrk")
def test_api_throughput(idle_api: str) -> None:
    key = new_key()
    with httpx.Client(base_url=idle_api, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        file_id = upload_ok(client, chat_rows(4))
        json_type = {"content-type": "application/json"}
        created = client.post("/v1/fine_tuning/jobs", content=_create_body(file_id), headers=json_type)
        assert created.status_code == 200, created.text
        job_url = f"{idle_api}/v1/fine_tuning/jobs/{created.json()['id']}"

    _wrk(job_url, key, 8, 2)  # warm-up: connections, caches, the interpreter's first paths
    loads = []
    for connections in CONNECTIONS:
        with HealthProbe(idle_api) as probe:
            out = _wrk(job_url, key, connections, SECONDS)
        loads.append(_parse(out, connections, max(probe.times, default=0) * 1000))
        loads[-1].healthz_p50_ms = statistics.median(probe.times or [0]) * 1000
        loads[-1].healthz_failures = probe.failures
        _drain(job_url, key)

    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "create.lua"
        body = _create_body(file_id).replace('"', '\\"')
        script.write_text(
            f'wrk.method = "POST"\nwrk.body = "{body}"\nwrk.headers["Content-Type"] = "application/json"\n'
        )
        creation_out = _wrk(f"{idle_api}/v1/fine_tuning/jobs", key, 8, SECONDS, script)
        creation = _parse(creation_out, 8, 0)
    # the same read once the creation row has queued its jobs: a queued job's position is its rank among
    # all of them, which must not make its read cost grow with the queue
    depth = 1 + int(re.search(r"(\d+) requests in", creation_out).group(1))  # type: ignore[union-attr]
    _drain(job_url, key)
    deep = _parse(_wrk(job_url, key, 50, SECONDS), 50, 0)

    print(f"\nGET /v1/fine_tuning/jobs/{{id}}, {SECONDS} s per row, {WORKERS} uvicorn process(es), wrk here")
    print("| connections | req/s | p50 ms | p99 ms | non-2xx | socket errors | /healthz p50 / max ms |")
    print("|---|---|---|---|---|---|---|")
    for load in loads:
        print(load.row())
    print(
        f"job creation (POST, 8 connections): {creation.rps:,.0f} jobs/s, p50 {creation.p50_ms:.1f} ms, "
        f"p99 {creation.p99_ms:.1f} ms, non-2xx {creation.non_2xx}"
    )
    print(
        f"with {depth:,} jobs queued: {deep.rps:,.0f} req/s at 50 connections, p50 {deep.p50_ms:.1f} ms, "
        f"p99 {deep.p99_ms:.1f} ms, non-2xx {deep.non_2xx}"
    )
    assert all(load.non_2xx == 0 and load.socket_errors == 0 for load in [*loads, creation, deep]), loads
    assert all(load.healthz_failures == 0 for load in loads), loads


@pytest.mark.slow
def test_dispatch_latency() -> None:
    """POST -> `running` with one idle Celery worker (its trainer process is spawned after the claim)."""
    url, server = start_server({"TUNEHOUSE_BROKER_URL": WORKER_BROKER})
    worker = subprocess.Popen(
        [sys.executable, "-m", "tunehouse.cli", "worker", "--loglevel", "warning"],
        env={**os.environ, "TUNEHOUSE_BROKER_URL": WORKER_BROKER},
    )
    latencies = []
    try:
        key = new_key()
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
            file_id = upload_ok(client, chat_rows(4))
            for attempt in range(DISPATCH_JOBS + 1):  # the first is a warm-up: the worker is still starting
                body = {
                    "model": MODEL,
                    "training_file": file_id,
                    "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1}}},
                }
                started = time.perf_counter()
                job_id = client.post("/v1/fine_tuning/jobs", json=body).json()["id"]
                while (status := client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"]) == "queued":
                    assert time.perf_counter() - started < 120, "the idle worker did not claim the job"
                    time.sleep(0.005)
                if attempt:
                    latencies.append(time.perf_counter() - started)
                assert status in ("running", *TERMINAL), status
                wait_for(client, job_id)
                # idle again: the job's status is final a moment before its trainer process exits
                while trainer_pid(job_id) is not None:
                    time.sleep(0.01)
    finally:
        _stop(worker)
        _stop(server)
    ms = sorted(s * 1000 for s in latencies)
    print(f"\ndispatch latency (POST -> running, idle worker): {', '.join(f'{v:.0f}' for v in ms)} ms")
    print(f"median {statistics.median(ms):.0f} ms")
