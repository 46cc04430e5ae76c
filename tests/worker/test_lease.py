"""The DB lease on real PostgreSQL: one live holder per job, takeover only after the heartbeat goes stale."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import update

from service.db import session_scope
from service.ids import new_id
from service.models import Job, Tenant
from worker import lease, reaper
from worker.supervisor import supervise_job

_created: list[str] = []


@pytest.fixture(autouse=True)
def _finish_created_jobs() -> Iterator[None]:
    # these rows have no files; end them so a live worker's reaper (e2e tests) never picks them up
    yield
    with session_scope() as session:
        session.execute(update(Job).where(Job.id.in_(_created)).values(status="failed"))
    _created.clear()


def _job(status: str = "queued", **values: Any) -> str:
    job_id = new_id("ftjob")
    _created.append(job_id)
    with session_scope() as session:
        tenant = Tenant(id=new_id("tenant"), name=f"lease-{job_id}")
        session.add(tenant)
        session.flush()
        session.add(
            Job(
                id=job_id,
                tenant_id=tenant.id,
                model="tunehouse/tiny-llama",
                training_file="file-x",
                method={"type": "supervised", "supervised": {"hyperparameters": {}}},
                seed=0,
                status=status,
                **values,
            )
        )
    return job_id


def _claim(job_id: str, worker: str, timeout: float = 10) -> bool:
    with session_scope() as session:
        return lease.claim(session, job_id=job_id, worker_id=worker, lease_timeout=timeout)


def test_only_one_worker_claims_a_job() -> None:
    job_id = _job()
    assert _claim(job_id, "a")
    assert not _claim(job_id, "b")  # a redelivered message meets a live lease
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None
        assert (job.status, job.worker_id, job.attempts) == ("running", "a", 1)
        assert job.started_at is not None


def test_stale_lease_is_taken_over_and_old_holder_loses_it() -> None:
    job_id = _job(status="running", worker_id="dead", heartbeat_at=time.time() - 60, attempts=1)
    assert _claim(job_id, "b", timeout=10)
    with session_scope() as session:
        assert not lease.heartbeat(session, job_id=job_id, worker_id="dead")
        assert not lease.finish(session, job_id=job_id, worker_id="dead", status="succeeded")
        assert lease.heartbeat(session, job_id=job_id, worker_id="b")
        job = session.get(Job, job_id)
        assert job is not None and job.attempts == 2


def test_cancel_wins_over_the_worker() -> None:
    job_id = _job()
    assert _claim(job_id, "a")
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None
        job.status = "cancelled"
    with session_scope() as session:
        assert not lease.heartbeat(session, job_id=job_id, worker_id="a")
        assert not lease.finish(session, job_id=job_id, worker_id="a", status="succeeded")
        job = session.get(Job, job_id)
        assert job is not None and job.status == "cancelled"


@pytest.mark.parametrize("status", ["succeeded", "failed", "cancelled"])
def test_supervisor_ignores_finished_jobs(status: str) -> None:
    assert supervise_job(_job(status=status), worker_id="w") is None


def test_supervisor_skips_a_job_held_by_a_live_worker() -> None:
    job_id = _job(status="running", worker_id="alive", heartbeat_at=time.time(), attempts=1)
    assert supervise_job(job_id, worker_id="w") is None
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None and job.worker_id == "alive"


def test_reaper_requeues_only_stale_running_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[str] = []
    monkeypatch.setattr(reaper, "send_task", lambda name, args: sent.append(args[0]))
    stale = _job(status="running", worker_id="dead", heartbeat_at=time.time() - 600)
    fresh = _job(status="running", worker_id="alive", heartbeat_at=time.time())
    queued = _job()
    reaper.requeue_stale_jobs()
    assert stale in sent and fresh not in sent and queued not in sent
