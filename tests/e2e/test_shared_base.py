"""LoRA jobs on one base model share one trainer process through the service (worker/shared_runs.py):
they run at the same time on one copy of the base, each with its own outcome, metrics and checkpoints;
a job joins while the others run; cancelling one leaves the others running; the process's death
restarts each job from its own checkpoint."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import _stop, new_key, redis_db, start_server
from tests.helpers import all_pages, chat_rows, trainer_pid, upload_ok, wait_for

BROKER = redis_db(4)  # (modules with stacks of their own take turns on it)
ENV = {
    "TUNEHOUSE_BROKER_URL": BROKER,
    "TUNEHOUSE_JOB_QUEUE": "tunehouse-shared",  # its own queue: no other worker claims these jobs
    "TUNEHOUSE_SHARED_BASE_JOBS": "3",
}
MODEL = "tunehouse/tiny-llama"


@pytest.fixture(scope="module")
def service() -> Iterator[str]:
    import redis

    redis.Redis.from_url(BROKER).flushdb()
    url, server = start_server(ENV)
    worker = subprocess.Popen(
        [sys.executable, "-m", "tunehouse.cli", "worker", "--loglevel", "warning"],
        env={**os.environ, **ENV},
    )
    try:
        yield url
    finally:
        _stop(worker)
        _stop(server)


@pytest.fixture
def tenants(service: str) -> Iterator[Callable[[], httpx.Client]]:
    """A client of a new tenant per call: the per-tenant running-job limit is not what is tested here."""
    with contextlib.ExitStack() as opened:

        def client() -> httpx.Client:
            headers = {"Authorization": f"Bearer {new_key()}"}
            return opened.enter_context(httpx.Client(base_url=service, headers=headers, timeout=60))

        yield client


def _submit(http: httpx.Client, *, seed: int, lr: float, epochs: int, rows: int = 16, **extra: Any) -> str:
    hp = {"n_epochs": epochs, "batch_size": 2, "learning_rate": lr, "save_steps": 4, **extra}
    created = http.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": MODEL,
            "training_file": upload_ok(http, chat_rows(rows)),
            "seed": seed,
            "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
        },
    )
    assert created.status_code == 200, created.text
    return str(created.json()["id"])


def _wait_until_in_one_process(jobs: list[str]) -> None:
    """Until every job runs, all in one trainer process at once."""
    deadline = time.monotonic() + 120
    while any(trainer_pid(j) is None for j in jobs):
        assert time.monotonic() < deadline, "the jobs never ran together"
        time.sleep(0.05)
    assert len({trainer_pid(j) for j in jobs}) == 1


def _events(http: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    return all_pages(http, f"/v1/fine_tuning/jobs/{job_id}/events")


def _losses(http: httpx.Client, job_id: str) -> list[float]:
    rows = all_pages(http, f"/v1/fine_tuning/jobs/{job_id}/metrics")
    return [row["loss"] for row in sorted(rows, key=lambda r: r["step"]) if "loss" in row]


def test_lora_jobs_share_one_process_and_train_as_alone(tenants: Callable[[], httpx.Client]) -> None:
    clients = [tenants() for _ in range(4)]
    jobs = [
        _submit(http, seed=seed, lr=lr, epochs=6)
        for http, (seed, lr) in zip(clients, [(1, 1e-3), (2, 3e-3), (3, 5e-4)], strict=False)
    ]
    _wait_until_in_one_process(jobs)
    finished = [wait_for(http, j, timeout=300) for http, j in zip(clients, jobs, strict=False)]
    assert all(job["status"] == "succeeded" for job in finished), finished
    for http, job_id in zip(clients, jobs, strict=False):
        started = [e for e in _events(http, job_id) if e["message"].startswith("Job started")]
        assert len(started) == 1, started
        worker = started[0]["data"]["worker"]
        assert re.fullmatch(r"[^:\s]+:\d+", worker), worker  # host:pid, the worker's id
        assert re.fullmatch(
            rf"Job started on worker {re.escape(worker)} \[cpu: [^\]]+\] \(attempt 1\), "
            r"sharing one copy of its base model with [0-2] other job\(s\)",
            started[0]["message"],
        ), started[0]["message"]
    # the first job again, alone now: the same losses (each job kept its own adapter, data order and
    # random state; see tests/trainers/families/test_shared_base.py for the tolerance)
    again = _submit(clients[3], seed=1, lr=1e-3, epochs=6)
    assert wait_for(clients[3], again, timeout=300)["status"] == "succeeded"
    together, alone = _losses(clients[0], jobs[0]), _losses(clients[3], again)
    assert len(together) == 48
    assert together == pytest.approx(alone, rel=1e-6)


def test_qlora_jobs_share_one_4bit_base(tenants: Callable[[], httpx.Client]) -> None:
    """Two QLoRA jobs train in one process on one 4-bit base: a fresh trainer with bitsandbytes (the
    worker's spare runs without it, worker/launch.py), each job ending with its own final model."""
    clients = [tenants() for _ in range(2)]
    jobs = [
        _submit(http, seed=i, lr=1e-3, epochs=3, rows=8, quantization="nf4") for i, http in enumerate(clients)
    ]
    _wait_until_in_one_process(jobs)
    finished = [wait_for(http, j, timeout=300) for http, j in zip(clients, jobs, strict=True)]
    assert all(job["status"] == "succeeded" for job in finished), finished
    for http, job in zip(clients, finished, strict=True):
        assert any("sharing one copy of its base model" in e["message"] for e in _events(http, job["id"]))
        checkpoints = all_pages(http, f"/v1/fine_tuning/jobs/{job['id']}/checkpoints")
        final = [c for c in checkpoints if c["fine_tuned_model_checkpoint"] == job["fine_tuned_model"]]
        assert len(final) == 1, checkpoints


def test_cancelling_one_job_leaves_the_others_running(tenants: Callable[[], httpx.Client]) -> None:
    a, b = tenants(), tenants()
    long_job = _submit(a, seed=5, lr=1e-3, epochs=10)  # 80 steps: running long after the cancel
    short_job = _submit(b, seed=6, lr=1e-3, epochs=3)
    deadline = time.monotonic() + 120
    while trainer_pid(long_job) is None or trainer_pid(short_job) is None:
        assert time.monotonic() < deadline, "the jobs never ran together"
        time.sleep(0.05)
    assert b.post(f"/v1/fine_tuning/jobs/{short_job}/cancel").status_code == 200
    assert wait_for(b, short_job, timeout=120)["status"] == "cancelled"
    assert a.get(f"/v1/fine_tuning/jobs/{long_job}").json()["status"] == "running"
    assert trainer_pid(long_job) is not None  # the same process trains on
    assert wait_for(a, long_job, timeout=300)["status"] == "succeeded"


def test_the_shared_process_dying_restarts_each_job_from_its_checkpoint(
    tenants: Callable[[], httpx.Client],
) -> None:
    a, b = tenants(), tenants()
    # 80 steps each, checkpoints every 4: the kill lands at the first ones, long before the end
    jobs = {a: _submit(a, seed=7, lr=1e-3, epochs=10), b: _submit(b, seed=8, lr=1e-3, epochs=10)}
    deadline = time.monotonic() + 180
    while not all(
        http.get(f"/v1/fine_tuning/jobs/{j}/checkpoints").json()["data"] for http, j in jobs.items()
    ):
        assert time.monotonic() < deadline, "no checkpoints"
        time.sleep(0.1)
    pid = trainer_pid(jobs[a])
    assert pid is not None and pid == trainer_pid(jobs[b])
    os.kill(pid, signal.SIGKILL)
    for http, job_id in jobs.items():
        job = wait_for(http, job_id, timeout=400)
        assert job["status"] == "succeeded", job
        messages = [e["message"] for e in _events(http, job_id)]
        assert any("Resuming from the checkpoint at step" in m for m in messages), messages
        restarted = "Job restarted (1 of 3): its shared-base trainer was killed by SIGKILL (out of memory"
        assert any(m.startswith(restarted) for m in messages), messages
        steps = sorted(
            int(r["step"]) for r in all_pages(http, f"/v1/fine_tuning/jobs/{job_id}/metrics") if "loss" in r
        )
        # every step once: the steps after the last checkpoint were trained again, not recorded twice
        assert steps == list(range(1, 8 * 10 + 1)), steps[:10]
