"""How long a metric row takes from the trainer's log call to a connected SSE client.

    make bench TRAINER_BENCH=--skip ARGS="-k stream_latency -s"

Two paths, measured in one run on the same machine: the live path (the worker publishes each row on
Redis the moment it is logged) against the baseline a deployment without Redis gets (the stream polls
the DB, where rows land at the reporter's flush, at least once a second). Latency = client receive
time - the trainer's `logged_at` stamp (same host, same clock).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import pytest

import tunehouse
from tests.conftest import REDIS, _stop, new_key, start_server
from tests.helpers import chat_rows, jsonl

STEPS = 120


def _measure(*, with_redis: bool) -> list[float]:
    broker = f"{REDIS}/11"
    import redis

    redis.Redis.from_url(broker).flushdb()
    env = {"TUNEHOUSE_BROKER_URL": broker, "TUNEHOUSE_REDIS_URL": f"{REDIS}/13" if with_redis else ""}
    url, server = start_server(env)
    worker = subprocess.Popen(
        [sys.executable, "-m", "tunehouse.cli", "worker", "--loglevel", "warning"], env={**os.environ, **env}
    )
    latencies: list[float] = []
    try:
        with tunehouse.Client(base_url=url, api_key=new_key()) as client:
            f = client.files.create(file=jsonl(chat_rows(16)))
            hp = {"n_epochs": STEPS // 8, "batch_size": 2, "lora": False, "learning_rate": 1e-3}
            job = client.fine_tuning.jobs.create(
                model="tunehouse/tiny-llama",
                training_file=f.id,
                method={"type": "supervised", "supervised": {"hyperparameters": hp}},
            )
            for item in client.fine_tuning.jobs.stream(job.id):
                received = time.time()
                logged = item.value("logged_at") if isinstance(item, tunehouse.MetricRow) else None
                if logged is not None:
                    latencies.append(received - logged)
    finally:
        _stop(worker)
        _stop(server)
    return latencies


def _summary(name: str, values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    p50, p95 = statistics.median(values), values[int(0.95 * (len(values) - 1))]
    print(
        f"{name}: n={len(values)} p50={p50 * 1000:.0f} ms p95={p95 * 1000:.0f} ms "
        f"max={values[-1] * 1000:.0f} ms"
    )
    return p50, p95


@pytest.mark.slow
def test_stream_latency() -> None:
    print()
    base50, base95 = _summary("baseline, DB polling (no Redis)", _measure(with_redis=False))
    live50, live95 = _summary("live, Redis pub/sub", _measure(with_redis=True))
    print(f"live / baseline: p50 {live50 / base50:.3f}x  p95 {live95 / base95:.3f}x")
    assert live95 < 1.0, "a metric must reach a connected client well under a second"
