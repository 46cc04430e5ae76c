"""A Redis that hangs (stopped, its socket open) holds up only the reporter's sender thread: the
training thread's flush at an epoch's end writes the rows to the DB without waiting on a publish.

The hung Redis here is a TCP listener that takes the PUBLISH and never answers, which is what a
stopped Redis is to its client (the kernel accepts; nobody replies). tests/faults/test_redis_outage.py
runs the same case end to end against a real redis-server stopped with SIGSTOP.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import select

from service.config import get_settings
from service.db import session_scope
from service.models import Job, JobMetric
from service.storage import LocalBlobStore
from tests.helpers import job_row, new_tenant
from worker.reporter import JobReporter


class HungRedis:
    """Accepts one client, reads its first command and then never answers until `release()`."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received = threading.Event()
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(65536)
            self.received.set()
            self._release.wait()  # then the connection closes: the hung publish fails at once

    def release(self) -> None:
        self._release.set()
        self._thread.join(timeout=10)
        self.listener.close()


@pytest.fixture
def hung_redis() -> Iterator[HungRedis]:
    server = HungRedis()
    yield server
    server.release()


def _running_job() -> tuple[str, str]:
    """A running job's row (and its tenant's id); a heartbeat far ahead, so no reconciler of another
    test's worker takes it for stale."""
    tenant = new_tenant("hung-redis")
    row = job_row(tenant.id, status="running", worker_id="w", heartbeat_at=time.time() + 10**6)
    with session_scope() as session:
        session.add(row)
    return row.id, tenant.id


def test_an_epochs_flush_does_not_wait_on_a_hung_publish(hung_redis: HungRedis, tmp_path: Path) -> None:
    job_id, tenant_id = _running_job()
    # a publish timeout far longer than the test: the publish hangs for as long as the server says
    publisher = redis.Redis(host="127.0.0.1", port=hung_redis.port, socket_timeout=600, retry=None)
    reporter = JobReporter(
        job_id=job_id,
        tenant_id=tenant_id,
        worker_id="w",
        fine_tuned_model="ft:x",
        settings=get_settings().model_copy(update={"metrics_flush_seconds": 3600.0}),
        blobs=LocalBlobStore(tmp_path),
        publisher=publisher,
    )
    reporter.on_train_begin(total_steps=3, n_epochs=1)
    for step in (1, 2, 3):
        reporter.on_step({"step": float(step), "epoch": 1.0, "loss": 1.0 / step})
    assert hung_redis.received.wait(30), "the sender never published"  # it now hangs on step 1

    epoch_end = threading.Thread(target=lambda: reporter.on_epoch_end(epoch=1, step=3), daemon=True)
    epoch_end.start()
    epoch_end.join(timeout=30)
    returned_while_hung = not epoch_end.is_alive()
    hung_redis.release()  # lets a training thread that waited on the publish go on, so the test ends
    epoch_end.join(timeout=30)
    reporter.close()
    publisher.close()

    assert returned_while_hung, "the epoch's flush waited on a publish to a Redis that hangs"
    with session_scope() as session:
        steps = session.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id)).all()
        current = session.scalar(select(Job.current_step).where(Job.id == job_id))
    assert sorted(steps) == [1, 2, 3]
    assert current == 3
