"""A worker's spare trainer (worker/spare_trainer.py) through a real worker, API, PostgreSQL and Redis:
started when the worker is ready, it trains the next one-rank job; the worker starts another when the
job's trainer exits; a spare that died while idle costs the next job nothing but the imports; the
worker's stop ends its spare. With `TUNEHOUSE_SPARE_TRAINER=false` it keeps none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import _stop, redis_db, start_server
from tests.helpers import chat_rows, spare_trainers, trainer_pid, until, upload_ok, wait_for

BROKER = redis_db(4)
# lone trainers (a spare also becomes a shared-base trainer: tests/e2e/test_shared_base.py)
ENV = {
    "TUNEHOUSE_BROKER_URL": BROKER,
    "TUNEHOUSE_JOB_QUEUE": "tunehouse-spare",
    "TUNEHOUSE_SHARED_BASE_JOBS": "1",
}


def _one_spare(worker: int) -> int | None:
    spares = spare_trainers(worker)
    assert len(spares) <= 1, spares
    return spares[0] if spares else None


def test_a_worker_trains_its_next_job_in_a_spare_started_ahead_and_keeps_one_ready(api_key: str) -> None:
    import redis

    redis.Redis.from_url(BROKER).flushdb()
    url, server = start_server(ENV)
    worker = subprocess.Popen(
        [sys.executable, "-m", "tunehouse.cli", "worker", "--loglevel", "warning"], env={**os.environ, **ENV}
    )
    try:
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60)
        train = upload_ok(client, chat_rows(8))

        def run_job() -> tuple[str, int]:
            body = {
                "model": "tunehouse/tiny-llama",
                "training_file": train,
                "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1}}},
            }
            job_id = client.post("/v1/fine_tuning/jobs", json=body).json()["id"]
            pid = until(lambda: trainer_pid(job_id), "the job's trainer")
            assert wait_for(client, job_id, timeout=180)["status"] == "succeeded"
            return job_id, pid

        spare = until(lambda: _one_spare(worker.pid), "a spare once the worker is ready")
        _, trained_by = run_job()
        assert trained_by == spare  # the job went to the spare, not to a process started for it
        until(lambda: not Path(f"/proc/{spare}").exists() or None, "the job's trainer to exit")
        following = until(lambda: _one_spare(worker.pid), "the next spare")
        assert following != spare

        # the spare dies while idle: the next job starts a trainer of its own, and a spare follows it
        os.kill(following, signal.SIGKILL)
        until(lambda: _one_spare(worker.pid) is None, "the killed spare to be gone")
        _, trained_by = run_job()
        assert trained_by != following
        last = until(lambda: _one_spare(worker.pid), "a spare after that job")

        _stop(worker)  # a warm shutdown ends the idle spare with the worker
        until(lambda: not Path(f"/proc/{last}").exists() or None, "the spare to end", timeout=30)
        client.close()
    finally:
        if worker.poll() is None:
            _stop(worker)
        _stop(server)


def test_a_worker_without_a_spare_starts_each_job_its_own_trainer(api_key: str) -> None:
    import redis

    redis.Redis.from_url(BROKER).flushdb()
    env = {**ENV, "TUNEHOUSE_SPARE_TRAINER": "false"}
    url, server = start_server(env)
    worker = subprocess.Popen(
        [sys.executable, "-m", "tunehouse.cli", "worker", "--loglevel", "warning"], env={**os.environ, **env}
    )
    try:
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60)
        body = {
            "model": "tunehouse/tiny-llama",
            "training_file": upload_ok(client, chat_rows(8)),
            "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1}}},
        }
        job_id = client.post("/v1/fine_tuning/jobs", json=body).json()["id"]
        pid = until(lambda: trainer_pid(job_id), "the job's trainer")
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"--spare" not in argv and job_id.encode() in argv  # started for the job, as it was named
        assert wait_for(client, job_id, timeout=180)["status"] == "succeeded"
        until(lambda: trainer_pid(job_id) is None, "the job's trainer to exit")
        time.sleep(1)  # a spare would be started as the trainer exits
        assert spare_trainers(worker.pid) == []
        client.close()
    finally:
        _stop(worker)
        _stop(server)
