"""Cancel, pause and resume (service/jobs/transitions.py) on real PostgreSQL, in this process: every
allowed change, its one event, its run message; every refused one, its 409 word for word and nothing
written; and a worker moving the job between the request's read and its write.

In-process (not through the API server) so that the mutation check can trace these tests to the code
(`make mutants MODULES=service/jobs/transitions.py`); tests/service/test_jobs_api.py covers the routes.
The rows live in a database of this module's own, away from the e2e worker's reconciler.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import select, update
from sqlalchemy.orm import Session

import service.db
import service.queue
from service.config import Settings
from service.db import session_scope
from service.errors import Conflict, NotFound
from service.ids import new_id
from service.jobs import transitions
from service.models import Job, JobEvent, Tenant
from service.queue import RUN_JOB_TASK
from tests.conftest import IDLE_BROKER, IDLE_QUEUE, free_port
from tests.helpers import job_row, new_tenant

Waiting = Callable[[], list[tuple[str, list[Any]]]]


pytestmark = pytest.mark.usefixtures("use_module_database")


@pytest.fixture
def tenant() -> Tenant:
    return new_tenant("transitions")


def _job(tenant: Tenant, status: str, **values: Any) -> str:
    row = job_row(tenant.id, status, **({"queue": IDLE_QUEUE} | values))
    with session_scope() as session:
        session.add(row)
    return row.id


def _sent_to(queue: str) -> list[str]:
    """The job ids of the run messages waiting in `queue` of the idle broker (no worker consumes it)."""
    broker = redis.Redis.from_url(IDLE_BROKER)
    try:
        bodies = [json.loads(base64.b64decode(json.loads(m)["body"])) for m in broker.lrange(queue, 0, -1)]
    finally:
        broker.close()
    return [args[0] for args, _, _ in bodies]


def _row(job_id: str) -> Job:
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def _events(job_id: str) -> list[tuple[str, dict[str, Any] | None]]:
    with session_scope() as session:
        rows = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq))
        return [(e.message, e.data) for e in rows]


def _act(action: Callable[..., Job], tenant: Tenant, job_id: str) -> Job:
    with session_scope() as session:
        return action(session, tenant=tenant, job_id=job_id)


# -- cancel -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("status", ["queued", "running", "paused"])
def test_cancel_ends_a_live_job_with_one_event(tenant: Tenant, status: str) -> None:
    job_id = _job(tenant, status, pause_requested=True)
    before = int(time.time())
    job = _act(transitions.cancel_job, tenant, job_id)
    row = _row(job_id)
    assert (job.status, row.status, row.pause_requested) == ("cancelled", "cancelled", False)
    assert row.finished_at is not None and before <= row.finished_at <= time.time()
    assert _events(job_id) == [
        ("Job cancelled by user", {"kind": "job.cancelled", "status": "cancelled", "requested": "cancel"})
    ]


@pytest.mark.parametrize("status", ["succeeded", "failed", "cancelled"])
def test_a_finished_job_cannot_be_cancelled(tenant: Tenant, status: str) -> None:
    job_id = _job(tenant, status, finished_at=7)
    with pytest.raises(Conflict) as raised:
        _act(transitions.cancel_job, tenant, job_id)
    assert raised.value.message == (
        f"job {job_id} has already {status}; only a queued, running or paused job can be cancelled"
    )
    assert (raised.value.param, raised.value.code) == ("fine_tuning_job_id", "job_not_cancellable")
    assert (_row(job_id).status, _row(job_id).finished_at, _events(job_id)) == (status, 7, [])


# -- pause --------------------------------------------------------------------------------------------------
def test_pause_of_a_queued_job_is_immediate(tenant: Tenant) -> None:
    job_id = _job(tenant, "queued", pause_requested=True)
    job = _act(transitions.pause_job, tenant, job_id)
    row = _row(job_id)
    assert (job.status, row.status, row.pause_requested) == ("paused", "paused", False)
    assert _events(job_id) == [("Job paused before it started", {"kind": "job.paused", "status": "paused"})]


def test_pause_of_a_running_job_is_a_request_the_trainer_carries_out_once(tenant: Tenant) -> None:
    job_id = _job(tenant, "running", worker_id="w1")
    for _ in range(2):  # asking twice changes nothing more
        job = _act(transitions.pause_job, tenant, job_id)
        assert (job.status, job.pause_requested) == ("running", True)
    row = _row(job_id)
    assert (row.status, row.pause_requested, row.worker_id) == ("running", True, "w1")
    assert _events(job_id) == [
        (
            "Pause requested: the trainer checkpoints and stops at its next step",
            {"kind": "job.pause_requested", "status": "running"},
        )
    ]


@pytest.mark.parametrize(
    ("status", "hint"),
    [
        ("paused", "; resume it with POST /v1/fine_tuning/jobs/{id}/resume"),
        ("succeeded", ""),
        ("cancelled", ""),
        ("failed", ""),
        ("validating_files", ""),
    ],
)
def test_only_a_queued_or_running_job_can_be_paused(tenant: Tenant, status: str, hint: str) -> None:
    job_id = _job(tenant, status)
    with pytest.raises(Conflict) as raised:
        _act(transitions.pause_job, tenant, job_id)
    state = f"has already {status}" if status in ("succeeded", "cancelled", "failed") else f"is {status}"
    assert raised.value.message == (
        f"job {job_id} {state}; only a queued or running job can be paused{hint.format(id=job_id)}"
    )
    assert (raised.value.param, raised.value.code) == ("fine_tuning_job_id", "job_not_pausable")
    assert (_row(job_id).status, _events(job_id)) == (status, [])


# -- resume -------------------------------------------------------------------------------------------------
def test_resume_queues_a_paused_job_and_sends_its_run_message_after_commit(
    tenant: Tenant, idle_broker: Waiting
) -> None:
    # a 2-GPU job: its message goes to its own queue, not the pool's default one
    queue = f"{IDLE_QUEUE}.gpus2"
    job_id = _job(
        tenant, "paused", worker_id="w1", heartbeat_at=5.0, queued_at=1.0, dispatched_at=1.0, queue=queue
    )
    before = time.time()
    with session_scope() as session:
        job = transitions.resume_job(session, tenant=tenant, job_id=job_id)
        assert job.status == "queued"
        assert job_id not in _sent_to(queue)  # not before the commit
    assert job_id in _sent_to(queue)  # (other tests' 2-GPU jobs may wait there too)
    assert (RUN_JOB_TASK, [job_id]) not in idle_broker()
    row = _row(job_id)
    assert (row.status, row.worker_id, row.heartbeat_at) == ("queued", None, None)
    assert row.queued_at is not None and row.queued_at == row.dispatched_at and row.queued_at >= before
    assert _events(job_id) == [
        (
            "Job resumed; queued to continue from its latest checkpoint",
            {"kind": "job.resumed", "status": "queued"},
        )
    ]


def test_resume_with_the_broker_down_leaves_the_job_queued_and_marked_unsent(
    tenant: Tenant, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The send after commit fails: the job stays queued, with no `dispatched_at`, so the next
    reconciler pass sends it at once instead of waiting out a dispatch timeout."""
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    app = service.queue.make_celery(Settings(broker_url=dead, data_dir=tmp_path))
    monkeypatch.setattr(service.queue, "get_celery", lambda: app)
    job_id = _job(tenant, "paused")
    job = _act(transitions.resume_job, tenant, job_id)
    row = _row(job_id)
    assert (job.status, row.status, row.dispatched_at) == ("queued", "queued", None)
    assert row.queued_at is not None


@pytest.mark.parametrize("status", ["queued", "running"])
def test_resume_withdraws_a_pause_not_yet_carried_out(
    tenant: Tenant, status: str, idle_broker: Waiting
) -> None:
    job_id = _job(tenant, status, pause_requested=True, worker_id="w1")
    job = _act(transitions.resume_job, tenant, job_id)
    row = _row(job_id)
    assert (job.status, row.status, row.pause_requested, row.worker_id) == (status, status, False, "w1")
    assert _events(job_id) == [
        ("Pause request withdrawn; the job carries on", {"kind": "job.pause_withdrawn", "status": status})
    ]
    assert (RUN_JOB_TASK, [job_id]) not in idle_broker()  # it never left its worker or the queue


@pytest.mark.parametrize(
    ("status", "hint"),
    [
        ("running", "; pause it with POST /v1/fine_tuning/jobs/{id}/pause"),
        ("queued", "; it starts when a worker is free"),
        ("succeeded", ""),
        ("cancelled", ""),
    ],
)
def test_only_a_paused_job_can_be_resumed(tenant: Tenant, status: str, hint: str) -> None:
    job_id = _job(tenant, status)
    with pytest.raises(Conflict) as raised:
        _act(transitions.resume_job, tenant, job_id)
    state = f"has already {status}" if status in ("succeeded", "cancelled") else f"is {status}"
    assert raised.value.message == (
        f"job {job_id} {state}; only a paused job can be resumed{hint.format(id=job_id)}"
    )
    assert (raised.value.param, raised.value.code) == ("fine_tuning_job_id", "job_not_resumable")
    assert (_row(job_id).status, _events(job_id)) == (status, [])


def test_another_tenants_job_is_not_found(tenant: Tenant) -> None:
    other = Tenant(id=new_id("tenant"), name=f"transitions-other-{new_id('t')}")
    with session_scope() as session:
        session.add(other)
    job_id = _job(tenant, "queued")
    for action in (transitions.cancel_job, transitions.pause_job, transitions.resume_job):
        with pytest.raises(NotFound):
            _act(action, other, job_id)
    assert (_row(job_id).status, _events(job_id)) == ("queued", [])


# -- a worker moves the job between the request's read and its write -------------------------------------
def _raced(
    tenant: Tenant, action: Callable[..., Job], seen: str, *, was: dict[str, Any] | None = None, **now: Any
) -> tuple[str, Job]:
    """Run `action` on a job its session has already read as `seen` (with `was`), after another connection
    (a worker) has committed `now` to the row: the request's compare-and-set expects the stale status."""
    job_id = _job(tenant, seen, **(was or {}))
    with session_scope() as session:
        stale = session.get(Job, job_id)
        assert stale is not None and stale.status == seen
        with session_scope() as worker:
            worker.execute(update(Job).where(Job.id == job_id).values(**now))
        return job_id, action(session, tenant=tenant, job_id=job_id)


def test_cancel_retries_from_the_status_a_worker_just_set(tenant: Tenant) -> None:
    job_id, job = _raced(tenant, transitions.cancel_job, "queued", status="running", worker_id="w1")
    assert job.status == "cancelled" and _row(job_id).status == "cancelled"
    assert [m for m, _ in _events(job_id)] == ["Job cancelled by user"]


def test_cancel_loses_to_a_job_that_just_finished(tenant: Tenant) -> None:
    with pytest.raises(Conflict, match="has already succeeded"):
        _raced(tenant, transitions.cancel_job, "running", status="succeeded")


def test_pause_of_a_job_a_worker_just_claimed_becomes_a_request(tenant: Tenant) -> None:
    job_id, job = _raced(tenant, transitions.pause_job, "queued", status="running", worker_id="w1")
    row = _row(job_id)
    assert (job.status, row.status, row.pause_requested) == ("running", "running", True)
    assert [d["kind"] for _, d in _events(job_id) if d] == ["job.pause_requested"]


def test_resume_of_a_job_a_worker_just_handed_back_paused(tenant: Tenant, idle_broker: Waiting) -> None:
    # seen running with a pause requested; the worker has since checkpointed and set it paused
    job_id, job = _raced(
        tenant,
        transitions.resume_job,
        "running",
        was={"pause_requested": True},
        status="paused",
        pause_requested=False,
    )
    assert job.status == "queued" and _row(job_id).status == "queued"
    assert [d["kind"] for _, d in _events(job_id) if d] == ["job.resumed"]
    assert (RUN_JOB_TASK, [job_id]) in idle_broker()


def test_a_request_gives_up_after_a_bounded_number_of_lost_races(
    tenant: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row that changes on every attempt (never in practice: each loss means the status moved on) ends
    the loop after `_ROUNDS` attempts with the job as last read, not in an endless loop."""
    job_id = _job(tenant, "queued")
    calls: list[int] = []

    def always_loses(session: Session, job: Job, *, expect: tuple[str, ...], **values: Any) -> bool:
        calls.append(1)
        return False

    monkeypatch.setattr(transitions, "move", always_loses)  # lifecycle.move, as transitions calls it
    job = _act(transitions.cancel_job, tenant, job_id)
    assert (job.status, len(calls), _events(job_id)) == ("queued", transitions._ROUNDS, [])
