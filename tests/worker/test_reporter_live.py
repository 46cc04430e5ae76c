"""The reporter's live path: steps faster than LIVE_BATCH_SECONDS go several to a Redis message, each
step once and in order (service/jobs/live.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from service.config import get_settings
from service.db import session_scope
from service.jobs.live import channel, message_rows
from service.storage import LocalBlobStore
from tests.helpers import job_row, new_tenant
from worker import reporter as reporter_module
from worker.reporter import JobReporter


def test_fast_steps_go_several_to_a_message_each_once_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a second between publishes: 20 steps 10 ms apart are one message after the first, on any machine
    monkeypatch.setattr(reporter_module, "LIVE_BATCH_SECONDS", 1.0)
    tenant = new_tenant("live-batches")
    row = job_row(tenant.id, status="running", worker_id="w", heartbeat_at=time.time() + 10**6)
    with session_scope() as session:
        session.add(row)
    settings = get_settings()
    assert settings.redis_url
    listener = redis.Redis.from_url(settings.redis_url).pubsub(ignore_subscribe_messages=True)
    listener.subscribe(channel(row.id))
    publisher = redis.Redis.from_url(settings.redis_url)
    reporter = JobReporter(
        job_id=row.id,
        tenant_id=tenant.id,
        worker_id="w",
        fine_tuned_model="ft:x",
        settings=settings.model_copy(update={"metrics_flush_seconds": 3600.0}),
        blobs=LocalBlobStore(tmp_path),
        publisher=publisher,
    )
    reporter.on_train_begin(total_steps=20, n_epochs=1)
    for step in range(1, 21):
        reporter.on_step({"step": float(step), "epoch": step / 20, "loss": 1.0 / step, "total_steps": 20.0})
        time.sleep(0.01)
    reporter.close()
    messages = []
    deadline = time.monotonic() + 2  # close() has published everything: what is in flight arrives
    while time.monotonic() < deadline:
        if (message := listener.get_message(timeout=0.2)) is not None:  # None: nothing, or the subscription
            messages.append(message_rows(json.loads(message["data"])))
    listener.close()
    publisher.close()
    batches = [rows for rows in messages if rows is not None]  # None: the "Training started" nudge
    steps = [r["step"] for rows in batches for r in rows]
    assert steps == list(range(1, 21))  # each once, in order, as integers
    assert len(batches) == 2  # the first step at once, the other 19 together
    assert batches[-1][-1]["total_steps"] == 20.0
