"""Fair share between tenants: the order in which queued jobs start, and each one's queue position.

A run message is a token meaning "a job is waiting", not "run this job": the worker that takes one
claims the fairest claimable queued job (worker/lease.py `claim_fair`). The fair order deals the
tenants round-robin, so one tenant's 100 queued jobs cannot starve another tenant's single one:

1. the job's turn within its tenant (its tenant's 1st queued job, 2nd, ...: round-robin),
2. the tenant's running jobs, fewest first,
3. when the tenant last had a job started, least recently (never) first,
4. the job's `queued_at`, then its id.

A tenant with `settings.max_running_jobs_per_tenant` running jobs (0: no limit) is skipped by the
claim. The queue position shown on a queued job is its rank in this same order, so position 1 is the
job the next free worker starts (unless its tenant is at its limit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from service.models import Job


@dataclass(frozen=True)
class Waiting:
    """A queued job and the figures that place it in the fair order."""

    job_id: str
    tenant_id: str
    queue: str
    turn: int  # 1 for the tenant's oldest queued job, 2 for the next, ...
    tenant_running: int
    tenant_last_started: int | None
    queued_at: float | None

    def key(self) -> tuple[int, int, int, float, str]:
        return (
            self.turn,
            self.tenant_running,
            -1 if self.tenant_last_started is None else self.tenant_last_started,
            self.queued_at if self.queued_at is not None else 0.0,
            self.job_id,
        )


@cache
def _fair_order_query() -> Select[Any]:
    """The fair order's statement, built once: it has no parameters, and building it (three subqueries
    and their column collections) was a third of the CPU of a queued job's read under load."""
    running = (
        select(Job.tenant_id, func.count().label("n"))
        .where(Job.status == "running")
        .group_by(Job.tenant_id)
        .subquery()
    )
    waiting_tenants = select(Job.tenant_id).where(Job.status == "queued")
    served = (
        select(Job.tenant_id, func.max(Job.started_at).label("last"))
        .where(Job.tenant_id.in_(waiting_tenants), Job.started_at.is_not(None))
        .group_by(Job.tenant_id)
        .subquery()
    )
    turn = func.row_number().over(partition_by=(Job.tenant_id, Job.queue), order_by=(Job.queued_at, Job.id))
    return (
        select(Job.id, Job.tenant_id, Job.queue, turn, running.c.n, served.c.last, Job.queued_at)
        .outerjoin(running, running.c.tenant_id == Job.tenant_id)
        .outerjoin(served, served.c.tenant_id == Job.tenant_id)
        .where(Job.status == "queued")
    )


def fair_order(session: Session, *, queues: Sequence[str] | None = None) -> list[Waiting]:
    """The queued jobs of `queues` (None: of every queue), fairest first. Running jobs count in every
    queue: the share and the limit are the tenant's, not per queue."""
    query = _fair_order_query()
    rows = session.execute(query if queues is None else query.where(Job.queue.in_(list(queues)))).all()
    waiting = [
        Waiting(
            job_id=job_id,
            tenant_id=tenant_id,
            queue=job_queue,
            turn=int(n_turn),
            tenant_running=int(n_running or 0),
            tenant_last_started=None if last is None else int(last),
            queued_at=queued_at,
        )
        for job_id, tenant_id, job_queue, n_turn, n_running, last, queued_at in rows
    ]
    return sorted(waiting, key=Waiting.key)


def queue_positions(session: Session, job_ids: list[str]) -> dict[str, int]:
    """1-based positions, each in the fair order of its own queue, of those of `job_ids` that are
    queued (one query)."""
    if not job_ids:
        return {}
    wanted = set(job_ids)
    seen: dict[str, int] = {}
    positions = {}
    for waiting in fair_order(session):
        seen[waiting.queue] = seen.get(waiting.queue, 0) + 1
        if waiting.job_id in wanted:
            positions[waiting.job_id] = seen[waiting.queue]
    return positions
