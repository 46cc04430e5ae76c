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

from sqlalchemy import ColumnElement, Select, Subquery, bindparam, func, select
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


@cache
def _ranked() -> Subquery:
    """Every queued job with the figures of the fair order and its `position` in its queue's order.

    The database ranks them, so that a queued job's read costs the API the same however deep the queue
    is (it had fetched and sorted every queued job: 3.9 ms of the API's CPU per read at 1,000 queued
    jobs, docs/benchmarks.md). Built once: it has no parameters, and building it (three subqueries and
    their column collections) was a third of the CPU of a queued job's read under load."""
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
    figures = (
        select(
            Job.id.label("job_id"),
            Job.tenant_id,
            Job.queue,
            turn.label("turn"),
            func.coalesce(running.c.n, 0).label("tenant_running"),
            served.c.last.label("tenant_last_started"),
            Job.queued_at,
        )
        .outerjoin(running, running.c.tenant_id == Job.tenant_id)
        .outerjoin(served, served.c.tenant_id == Job.tenant_id)
        .where(Job.status == "queued")
        .subquery()
    )
    position = func.row_number().over(partition_by=figures.c.queue, order_by=_fair_key(figures))
    return select(figures, position.label("position")).subquery()


def _fair_key(figures: Any) -> tuple[ColumnElement[Any], ...]:
    """The fair order (the module's docstring), over `figures`' columns: turn, the tenant's running
    jobs, when it was last served (never: first), queued_at, id."""
    return (
        figures.c.turn,
        figures.c.tenant_running,
        func.coalesce(figures.c.tenant_last_started, -1),
        func.coalesce(figures.c.queued_at, 0.0),
        figures.c.job_id,
    )


def fair_order(session: Session, *, queues: Sequence[str] | None = None) -> list[Waiting]:
    """The queued jobs of `queues` (None: of every queue), fairest first. Running jobs count in every
    queue: the share and the limit are the tenant's, not per queue."""
    if queues is None:
        return [Waiting(*row) for row in session.execute(_fair_order_query())]
    return [Waiting(*row) for row in session.execute(_fair_order_of_queues(), {"queues": list(queues)})]


_WAITING_COLUMNS = (
    "job_id",
    "tenant_id",
    "queue",
    "turn",
    "tenant_running",
    "tenant_last_started",
    "queued_at",
)


# The statements below are built once, with their parameters bound at execution: the cache key of a
# statement built per call walks the whole nested query (most of a read's cost at 1,000 queued jobs).


@cache
def _fair_order_query() -> Select[Any]:
    ranked = _ranked()
    return select(*(ranked.c[name] for name in _WAITING_COLUMNS)).order_by(*_fair_key(ranked))


@cache
def _fair_order_of_queues() -> Select[Any]:
    return _fair_order_query().where(_ranked().c.queue.in_(bindparam("queues", expanding=True)))


@cache
def _positions_query() -> Select[Any]:
    ranked = _ranked()
    return select(ranked.c.job_id, ranked.c.position).where(
        ranked.c.job_id.in_(bindparam("job_ids", expanding=True))
    )


def queue_positions(session: Session, job_ids: list[str]) -> dict[str, int]:
    """1-based positions, each in the fair order of its own queue, of those of `job_ids` that are
    queued (one query, which returns only their rows)."""
    if not job_ids:
        return {}
    rows = session.execute(_positions_query(), {"job_ids": job_ids})
    return {job_id: int(position) for job_id, position in rows}
