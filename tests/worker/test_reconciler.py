"""The outbox reconciler and the restart rules, on a real database (an SQLite file of the test's own,
so no other module's worker reconciles these rows) and a real Redis broker (a db of the test Redis,
or a closed port for a broker that is down)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import select
from sqlalchemy.orm import sessionmaker

import service.db
import service.queue
from service.config import Settings
from service.db import make_engine, session_scope
from service.jobs import dispatch
from service.jobs.dispatch import reconcile, send_after_commit
from service.jobs.lifecycle import queued_values
from service.migrate import upgrade_head
from service.models import Job, JobEvent, Tenant
from tests.conftest import free_port, redis_db
from worker.recovery import describe_exit, hand_back, held_by, restart_or_fail

BROKER = redis_db(4)


@pytest.fixture
def own_db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    url = f"sqlite:///{tmp_path / 'jobs.sqlite'}"
    upgrade_head(url)
    engine = make_engine(url)
    maker = sessionmaker(bind=engine, expire_on_commit=False)
    monkeypatch.setattr(service.db, "get_sessionmaker", lambda: maker)
    with session_scope() as session:
        session.add(Tenant(id="tenant-r", name="reconciler"))
    yield
    engine.dispose()


def _broker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, url: str) -> None:
    app = service.queue.make_celery(Settings(broker_url=url, data_dir=tmp_path))
    monkeypatch.setattr(service.queue, "get_celery", lambda: app)


@pytest.fixture
def broker(own_db: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> redis.Redis:
    client = redis.Redis.from_url(BROKER)
    client.flushdb()
    _broker(monkeypatch, tmp_path, BROKER)
    return client


@pytest.fixture
def dead_broker(own_db: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _broker(monkeypatch, tmp_path, f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there


def _job(job_id: str, **values: Any) -> str:
    row = {"status": "queued", **values}
    with session_scope() as session:
        session.add(
            Job(
                id=job_id,
                tenant_id="tenant-r",
                model="m",
                training_file="file-x",
                method={"type": "supervised"},
                seed=0,
                **row,
            )
        )
    return job_id


def _row(job_id: str) -> Job:
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def _sent(client: redis.Redis) -> list[str]:
    """Job ids of the run messages waiting in the broker's queue."""
    return [
        job_id
        for raw in client.lrange("tunehouse", 0, -1)
        for job_id in ("a", "b", "c", "d", "j")
        if f"ftjob-{job_id}'" in raw.decode()
    ]


def test_unclaimed_queued_jobs_are_sent_again_with_backoff(broker: redis.Redis) -> None:
    t = time.time()
    _job("ftjob-a", **queued_values(t - 100))  # sent 100 s ago, never claimed: lost
    _job("ftjob-b", **queued_values(t - 10))  # sent 10 s ago: give it time
    _job("ftjob-c", **{**queued_values(t - 1000), "status": "running"})  # claimed
    _job("ftjob-d", **{**queued_values(t - 1), "dispatched_at": None})  # its send failed: at once
    assert sorted(reconcile(dispatch_timeout=60)) == ["ftjob-a", "ftjob-d"]
    assert sorted(_sent(broker)) == ["a", "d"]
    assert _row("ftjob-a").dispatched_at == pytest.approx(time.time(), abs=5)
    # a second pass (another worker's reconciler, at once) sends nothing again
    assert reconcile(dispatch_timeout=60) == []
    assert len(broker.lrange("tunehouse", 0, -1)) == 2


def test_resends_back_off_while_a_job_waits() -> None:
    due = dispatch._resend_due
    # queued at 0, timeout 60: sent at 0, re-sent at 60, then 120, 240, 480, ... capped at 600 apart
    assert not due(59, 0, 0, 60) and due(60, 0, 0, 60)
    assert not due(119, 0, 60, 60) and due(120, 0, 60, 60)
    assert not due(239, 0, 120, 60) and due(240, 0, 120, 60)
    assert not due(10_000 + 599, 0, 10_000, 60) and due(10_000 + 600, 0, 10_000, 60)
    assert due(0, 0, None, 60)  # never sent: at once


def test_broker_down_keeps_jobs_queued_for_the_next_pass(
    dead_broker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    tries: list[str] = []

    def counted(name: str, args: list[Any], *, queue: str | None = None) -> bool:  # the real send, counted
        tries.append(args[0])
        return real_send(name, args, queue=queue)

    real_send = service.queue.send_task
    monkeypatch.setattr(service.queue, "send_task", counted)  # dispatch imports it at the send
    t = time.time()
    _job("ftjob-a", **{**queued_values(t), "dispatched_at": None})
    _job("ftjob-b", **queued_values(t - 100))
    started = time.monotonic()
    assert reconcile(dispatch_timeout=60) == []
    assert time.monotonic() - started < 5  # bounded: a short retry policy...
    assert len(tries) == 1  # ...and the pass gives up at the first failed send
    assert _row("ftjob-a").dispatched_at is None
    assert _row("ftjob-b").dispatched_at == pytest.approx(t - 100)

    # the API's path: the job is committed, the send after commit fails, the row says "unsent"
    started = time.monotonic()
    with session_scope() as session:
        _job("ftjob-j", **queued_values(t))
        send_after_commit(session, "ftjob-j", t, queue="tunehouse")
    assert time.monotonic() - started < 5
    assert _row("ftjob-j").dispatched_at is None


def _kinds(job_id: str) -> list[str]:
    with session_scope() as session:
        events = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq))
        return [e.data["kind"] for e in events if e.data]


def test_a_crashed_run_restarts_until_the_limit_then_fails(broker: redis.Redis) -> None:
    _job("ftjob-j", status="running", worker_id="w1")
    cause = describe_exit(-9)
    assert cause == "the trainer process was killed by SIGKILL (out of memory, or killed by an operator)"
    with session_scope() as session:  # someone else's lease: not ours to restart
        assert (
            restart_or_fail(session, job_id="ftjob-j", expect=held_by("w2"), cause=cause, max_restarts=1)
            is None
        )
    with session_scope() as session:
        assert (
            restart_or_fail(session, job_id="ftjob-j", expect=held_by("w1"), cause=cause, max_restarts=1)
            == "queued"
        )
    job = _row("ftjob-j")
    assert (job.status, job.restarts, job.worker_id) == ("queued", 1, None)
    assert _sent(broker) == ["j"]  # back in the broker's queue

    with session_scope() as session:  # claimed again, and killed again: out of restarts
        session.execute(
            Job.__table__.update().where(Job.id == "ftjob-j").values(status="running", worker_id="w2")
        )
    with session_scope() as session:
        assert (
            restart_or_fail(session, job_id="ftjob-j", expect=held_by("w2"), cause=cause, max_restarts=1)
            == "failed"
        )
    job = _row("ftjob-j")
    assert job.status == "failed" and job.restarts == 1 and job.finished_at is not None
    assert job.error == {
        "code": "internal_error",
        "message": f"{cause}; gave up after 1 restart(s)",
        "param": None,
        "fault": "system",
    }
    assert _kinds("ftjob-j") == ["job.restarted", "job.failed"]
    assert describe_exit(3) == "the trainer process exited with code 3"


def test_a_pause_requested_meanwhile_wins_over_the_queue(broker: redis.Redis) -> None:
    _job("ftjob-a", status="running", worker_id="w1", pause_requested=True)
    _job("ftjob-b", status="running", worker_id="w1")
    with session_scope() as session:
        assert hand_back(session, job_id="ftjob-a", worker_id="w1", why="pause requested") == "paused"
        assert hand_back(session, job_id="ftjob-b", worker_id="w1", why="shutting down") == "queued"
    a, b = _row("ftjob-a"), _row("ftjob-b")
    assert (a.status, a.pause_requested, a.restarts, a.worker_id) == ("paused", False, 0, None)
    assert (b.status, b.restarts, b.worker_id) == ("queued", 0, None)  # a hand-back is not a restart
    assert _sent(broker) == ["b"]
    assert _kinds("ftjob-a") == ["job.paused"] and _kinds("ftjob-b") == ["job.handed_back"]
