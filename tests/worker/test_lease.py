"""The DB lease on real PostgreSQL: one live holder per job, takeover only after the heartbeat goes stale.

These rows live in a PostgreSQL database of this module's own: the e2e tests' worker stays alive for the
whole session, and its reconciler would otherwise race these tests for every stale or unsent row.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import update

from service.db import session_scope
from service.ids import new_id
from service.jobs import lifecycle
from service.models import Job, Tenant
from service.queue import RUN_JOB_TASK
from tests.conftest import IDLE_QUEUE
from tests.helpers import job_row
from worker import reaper
from worker.supervisor import supervise_job

pytestmark = pytest.mark.usefixtures("use_module_database")


def _job(status: str = "queued", **values: Any) -> str:
    job_id = new_id("ftjob")
    with session_scope() as session:
        tenant = Tenant(id=new_id("tenant"), name=f"lease-{job_id}")
        session.add(tenant)
        session.flush()
        session.add(job_row(tenant.id, status, id=job_id, **values))
    return job_id


def _claim(job_id: str, worker: str, timeout: float = 10) -> bool:
    with session_scope() as session:
        return lifecycle.claim(session, job_id=job_id, worker_id=worker, lease_timeout=timeout)


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
    job_id = _job(status="running", worker_id="dead", heartbeat_at=time.time() - 60, attempts=1, started_at=5)
    assert _claim(job_id, "b", timeout=10)
    with session_scope() as session:
        assert not lifecycle.heartbeat(session, job_id=job_id, worker_id="dead")
        assert not lifecycle.finish(session, job_id=job_id, worker_id="dead", status="succeeded")
        assert lifecycle.heartbeat(session, job_id=job_id, worker_id="b")
        job = session.get(Job, job_id)
        assert job is not None and job.attempts == 2
        assert job.started_at == 5  # a takeover resumes the job: it started when the first worker began


def test_a_running_job_that_never_heartbeat_can_be_taken_over() -> None:
    job_id = _job(status="running", worker_id="died-at-start", heartbeat_at=None, attempts=1)
    assert _claim(job_id, "b")


def test_heartbeat_and_finish_touch_only_the_job_named() -> None:
    done, other, waiting = _job(), _job(), _job()
    assert _claim(done, "a") and _claim(other, "a")  # one worker, two jobs (two processes)
    with session_scope() as session:
        job = session.get(Job, waiting)
        assert job is not None and job.started_at is None  # claims start only the job they claim
        session.execute(update(Job).where(Job.id == other).values(heartbeat_at=1.0))
    with session_scope() as session:
        assert lifecycle.heartbeat(session, job_id=done, worker_id="a")
    with session_scope() as session:
        job = session.get(Job, other)
        assert job is not None and job.heartbeat_at == 1.0  # not refreshed by the other job's heartbeat
        assert lifecycle.finish(session, job_id=done, worker_id="a", status="succeeded")
    with session_scope() as session:
        finished, running = session.get(Job, done), session.get(Job, other)
        assert finished is not None and running is not None
        assert (finished.status, running.status) == ("succeeded", "running")
        assert finished.finished_at is not None and running.finished_at is None


def test_cancel_wins_over_the_worker() -> None:
    job_id = _job()
    assert _claim(job_id, "a")
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None
        job.status = "cancelled"
    with session_scope() as session:
        assert not lifecycle.heartbeat(session, job_id=job_id, worker_id="a")
        assert not lifecycle.finish(session, job_id=job_id, worker_id="a", status="succeeded")
        job = session.get(Job, job_id)
        assert job is not None and job.status == "cancelled"


def test_release_clears_only_our_ended_job() -> None:
    ended, running, theirs = _job(), _job(), _job()
    for job_id, worker in ((ended, "a"), (running, "a"), (theirs, "b")):
        assert _claim(job_id, worker)
    with session_scope() as session:
        session.execute(update(Job).where(Job.id.in_((ended, theirs))).values(status="cancelled"))
    with session_scope() as session:
        assert not lifecycle.release(session, job_id=running, worker_id="a")  # still running: kept
        assert not lifecycle.release(session, job_id=theirs, worker_id="a")  # another worker's
        assert lifecycle.release(session, job_id=ended, worker_id="a")
    with session_scope() as session:
        holders = {j: session.get(Job, j).worker_id for j in (ended, running, theirs)}  # type: ignore[union-attr]
    assert holders == {ended: None, running: "a", theirs: "b"}


def _nothing_else_waits() -> None:
    # a run message is a token: with another job queued the supervisor would (rightly) run that one
    with session_scope() as session:
        session.execute(update(Job).where(Job.status == "queued").values(status="cancelled"))


@pytest.mark.parametrize("status", ["succeeded", "failed", "cancelled"])
def test_supervisor_ignores_finished_jobs(status: str) -> None:
    job_id = _job(status=status)
    _nothing_else_waits()
    assert supervise_job(job_id, worker_id="w") is None
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None and job.status == status and job.attempts == 0


def test_supervisor_skips_a_job_held_by_a_live_worker() -> None:
    job_id = _job(status="running", worker_id="alive", heartbeat_at=time.time(), attempts=1)
    _nothing_else_waits()
    assert supervise_job(job_id, worker_id="w") is None
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None and job.worker_id == "alive"


def test_reaper_requeues_only_stale_running_jobs(
    idle_broker: Callable[[], list[tuple[str, list[Any]]]],
) -> None:
    # in the idle broker's queue, where the reaper sends each job's message (its stored queue)
    stale = _job(status="running", worker_id="dead", heartbeat_at=time.time() - 600, queue=IDLE_QUEUE)
    fresh = _job(status="running", worker_id="alive", heartbeat_at=time.time())
    queued = _job()
    assert stale in reaper.requeue_stale_jobs()
    sent = [args[0] for name, args in idle_broker() if name == RUN_JOB_TASK]
    assert stale in sent and fresh not in sent and queued not in sent  # on the real broker
    with session_scope() as session:
        job = session.get(Job, stale)
        assert job is not None
        # a charged restart: the dead worker's job resumes from its checkpoint on another worker
        assert (job.status, job.worker_id, job.restarts) == ("queued", None, 1)


def test_stale_running_jobs_lists_only_running_jobs_with_a_stale_heartbeat() -> None:
    # in the idle broker's queue, where the reaper sends each job's message (its stored queue)
    stale = _job(status="running", worker_id="dead", heartbeat_at=time.time() - 600, queue=IDLE_QUEUE)
    fresh = _job(status="running", worker_id="alive", heartbeat_at=time.time())
    queued, done = _job(), _job(status="succeeded")  # no heartbeat, but not running
    with session_scope() as session:
        ids = set(lifecycle.stale_running_jobs(session, lease_timeout=10))
    assert stale in ids and not {fresh, queued, done} & ids
