"""The fair-share order, the per-tenant limit and queue positions, on real PostgreSQL.

A database of this module's own (as in test_lease.py): the e2e tests' worker would otherwise claim
these queued rows. Each test starts from an empty queue.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.orm import sessionmaker

from service.db import session_scope
from service.ids import new_id
from service.jobs import fairness, lifecycle
from service.jobs.fairness import fair_order, queue_positions
from service.models import Job, Tenant


@pytest.fixture(autouse=True)
def _empty_queue(use_module_database: sessionmaker[Any]) -> None:
    with session_scope() as session:
        session.execute(update(Job).where(Job.status.in_(("queued", "running"))).values(status="cancelled"))


def _tenant() -> str:
    tenant_id = new_id("tenant")
    with session_scope() as session:
        session.add(Tenant(id=tenant_id, name=tenant_id))
    return tenant_id


_clock = [time.time()]


def _job(tenant_id: str, status: str = "queued", **values: Any) -> str:
    """A job row; queued ones get increasing `queued_at` in the order they are made."""
    _clock[0] += 1.0
    job_id = new_id("ftjob")
    fields: dict[str, Any] = {
        "model": "tunehouse/tiny-llama",
        "method": {"type": "supervised", "supervised": {"hyperparameters": {}}},
        **values,
    }
    with session_scope() as session:
        session.add(
            Job(
                id=job_id,
                tenant_id=tenant_id,
                training_file="file-x",
                seed=0,
                status=status,
                queued_at=_clock[0],
                **fields,
            )
        )
    return job_id


def _order() -> list[str]:
    with session_scope() as session:
        return [w.job_id for w in fair_order(session, queues=["tunehouse"])]


def _positions(job_ids: list[str]) -> list[int]:
    with session_scope() as session:
        positions = queue_positions(session, job_ids)
    return [positions[j] for j in job_ids]


def test_one_tenants_backlog_does_not_starve_another() -> None:
    """Tenants take turns: A's 4 jobs wait earlier, B's single job and C's two come after, yet B and C
    each start within one turn; within a tenant, first in first out."""
    a, b, c = _tenant(), _tenant(), _tenant()
    _job(a, status="succeeded", started_at=int(time.time()) - 60)  # A was served before
    a_jobs = [_job(a) for _ in range(4)]
    b1 = _job(b)
    c_jobs = [_job(c), _job(c)]
    # each turn: tenants never served first (first in first out between them), then A
    expected = [b1, c_jobs[0], a_jobs[0], c_jobs[1], a_jobs[1], a_jobs[2], a_jobs[3]]
    assert _order() == expected
    assert _positions(expected) == list(range(1, 8))


def test_a_tenant_with_running_jobs_waits_behind_one_without() -> None:
    a, b = _tenant(), _tenant()
    _job(a, status="running", worker_id="w", heartbeat_at=time.time(), started_at=int(time.time()))
    a2 = _job(a)
    b1 = _job(b, started_at=None)
    _job(b, status="succeeded", started_at=int(time.time()))  # B was served as recently as A
    assert _order() == [b1, a2]


def test_positions_are_counted_within_each_queue_and_only_for_queued_jobs() -> None:
    a = _tenant()
    first, other_queue = _job(a), _job(a, queue="tunehouse-other")
    done = _job(a, status="succeeded")
    with session_scope() as session:
        assert queue_positions(session, [first, other_queue, done]) == {first: 1, other_queue: 1}
    assert _order() == [first]


def test_positions_of_one_job_and_of_a_whole_page_both_follow_the_fair_order() -> None:
    """A few asked jobs get their positions counted one by one, many get them from one rank of the queue
    (``fairness._COUNTED_UP_TO``): both give each job its place in its own queue's fair order, ties in
    every figure but the last included (tenants never served, served at the same second, running jobs)."""
    tenants = [_tenant() for _ in range(4)]
    now = int(time.time())
    _job(tenants[0], status="running", worker_id="w", heartbeat_at=time.time(), started_at=now)
    _job(tenants[1], status="succeeded", started_at=now - 60)
    _job(tenants[2], status="succeeded", started_at=now - 60)
    queued = [_job(tenants[i % 4], queue="tunehouse" if i % 5 else "tunehouse-other") for i in range(14)]
    with session_scope() as session:  # queued at the same time: only their ids tell tied jobs apart
        session.execute(update(Job).where(Job.id.in_(queued)).values(queued_at=_clock[0]))
    with session_scope() as session:
        order = fair_order(session)
        one_by_one = {j: queue_positions(session, [j])[j] for j in queued}
        all_at_once = queue_positions(session, queued)
    seen: dict[str, int] = {}
    expected = {}
    for waiting in order:
        seen[waiting.queue] = seen.get(waiting.queue, 0) + 1
        expected[waiting.job_id] = seen[waiting.queue]
    assert len(queued) > fairness._COUNTED_UP_TO
    assert one_by_one == expected
    assert all_at_once == expected
    assert sorted(expected.values()) == sorted([*range(1, 12), *range(1, 4)])


def _claim(limit: int, worker: str = "w") -> str | None:
    return lifecycle.claim_fair(worker_id=worker, queues=["tunehouse"], max_running_per_tenant=limit)


def test_claim_takes_the_fairest_job_and_skips_a_tenant_at_its_limit() -> None:
    a, b = _tenant(), _tenant()
    a_jobs = [_job(a) for _ in range(3)]
    b1 = _job(b)
    assert _claim(limit=1) == a_jobs[0]  # nobody served yet: the oldest
    assert _claim(limit=1) == b1  # A is at its limit of 1 running job
    assert _claim(limit=1) is None  # both at their limit; A's other jobs stay queued
    with session_scope() as session:
        assert session.scalar(select(Job.status).where(Job.id == a_jobs[1])) == "queued"
        session.execute(update(Job).where(Job.id == a_jobs[0]).values(status="succeeded"))
    assert _claim(limit=1) == a_jobs[1]  # a running job ended: A's next may start
    assert _claim(limit=0) == a_jobs[2]  # 0: no limit


def test_claim_stays_in_its_queue() -> None:
    a = _tenant()
    _job(a, queue="tunehouse-other")
    assert _claim(limit=0) is None


def test_concurrent_claims_take_distinct_jobs_and_respect_the_limit() -> None:
    """Eight workers claim at once: no job is claimed twice, and A never runs more than its limit."""
    a, b = _tenant(), _tenant()
    for _ in range(6):
        _job(a)
    b_jobs = [_job(b) for _ in range(2)]
    claimed: list[str | None] = []
    start = threading.Barrier(8)

    def worker(n: int) -> None:
        start.wait()
        claimed.append(_claim(limit=2, worker=f"w{n}"))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = [j for j in claimed if j is not None]
    assert len(got) == len(set(got)) == 4  # 2 of A's, both of B's
    with session_scope() as session:
        running = session.execute(
            select(Job.tenant_id, func.count()).where(Job.status == "running").group_by(Job.tenant_id)
        ).all()
    assert dict(running) == {a: 2, b: 2}
    assert set(b_jobs) <= set(got)


def _method(kind: str = "supervised", **hp: Any) -> dict[str, Any]:
    return {"type": kind, kind: {"hyperparameters": hp}}


def test_which_jobs_share_a_base() -> None:
    """LoRA jobs on one model with the same precision, quantization and kernels share, whatever their
    method (a reward model's classifier too); a full fine-tune or a multi-rank job trains alone."""
    from worker.shared_runs import share_key

    a = _tenant()
    key = share_key(_job(a, method=_method()))
    assert key is not None
    assert share_key(_job(a, method=_method("dpo"))) == key  # any method
    assert share_key(_job(a, method=_method("reward_model"))) == key  # its classifier on the causal LM
    assert share_key(_job(_tenant(), method=_method())) == key  # any tenant
    assert share_key(_job(a, method=_method(mixed_precision="bf16"))) not in (None, key)
    assert share_key(_job(a, method=_method(gradient_checkpointing=True))) not in (None, key)
    assert share_key(_job(a, method=_method(), model="tunehouse/other")) not in (None, key)
    assert share_key(_job(a, method=_method(lora=False))) is None
    nf4 = share_key(_job(a, method=_method(quantization="nf4")))
    assert nf4 is not None and nf4 != key and nf4.quantization == "nf4"  # QLoRA jobs share a 4-bit base
    assert share_key(_job(_tenant(), method=_method("dpo", quantization="nf4"))) == nf4
    assert share_key(_job(a, method=_method(quantization="int8"))) not in (None, key, nf4)
    assert share_key(_job(a, method=_method(), resources={"gpus": 2})) is None


def test_a_shared_base_takes_in_the_fairest_job_only_if_it_shares_the_base() -> None:
    """A worker whose shared trainer has room claims with `accept`: the fairest job if it fits, else
    none, never a less fair job that fits (fair share holds while jobs share a base)."""
    a, b = _tenant(), _tenant()
    other = _job(a, model="tunehouse/other")
    fits = _job(b)

    def same_base(job_id: str) -> bool:
        return job_id == fits

    assert (
        lifecycle.claim_fair(worker_id="w", queues=["tunehouse"], max_running_per_tenant=0, accept=same_base)
        is None
    )
    with session_scope() as session:
        assert session.scalar(select(Job.status).where(Job.id == fits)) == "queued"
    assert _claim(limit=0) == other  # a claim without a shared trainer takes the fairest
    assert (
        lifecycle.claim_fair(worker_id="w", queues=["tunehouse"], max_running_per_tenant=0, accept=same_base)
        == fits
    )
