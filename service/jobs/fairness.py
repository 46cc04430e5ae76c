"""Fair share between tenants: the order in which queued jobs start, and each one's queue position.

A run message is a token meaning "a job is waiting", not "run this job": the worker that takes one
claims the fairest claimable queued job (service/jobs/lifecycle.py `claim_fair`). The fair order deals the
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
from dataclasses import dataclass, fields
from functools import cache
from typing import Any

from sqlalchemy import CTE, ColumnElement, ScalarSelect, Select, bindparam, case, func, null, select, tuple_
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
def _figures() -> CTE:
    """Every queued job with the figures that place it in the fair order (`_fair_key`).

    Built once: it has no parameters, and building it (three subqueries and their column collections)
    was a third of the CPU of a queued job's read under load."""
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
        .cte("queued_figures")
    )


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
    """The queued jobs of `queues` (None: of every queue), fairest first, as the database orders them.
    Running jobs count in every queue: the share and the limit are the tenant's, not per queue."""
    if queues is None:
        return [Waiting(*row) for row in session.execute(_fair_order_query())]
    return [Waiting(*row) for row in session.execute(_fair_order_of_queues(), {"queues": list(queues)})]


_WAITING_COLUMNS = tuple(f.name for f in fields(Waiting))  # the order the fair-order query selects


# The statements below are built once, with their parameters bound at execution: the cache key of a
# statement built per call walks the whole nested query (most of a read's cost at 1,000 queued jobs).


@cache
def _fair_order_query() -> Select[Any]:
    figures = _figures()
    return select(*(figures.c[name] for name in _WAITING_COLUMNS)).order_by(*_fair_key(figures))


@cache
def _fair_order_of_queues() -> Select[Any]:
    return _fair_order_query().where(_figures().c.queue.in_(bindparam("queues", expanding=True)))


# Up to this many asked jobs, a count per job (`_counted_positions`); more, one rank of the whole queue
# (`_ranked_positions`). At a thousand queued jobs one rank of the queue cost about two single counts
# and a sixth of a page of 100 counted one by one (figures: git log -p docs/benchmarks.md).
_COUNTED_UP_TO = 8


def _counted(asked: Any) -> ScalarSelect[int]:
    """`asked`'s position, counted: how many queued jobs of its queue come before it or are it (no sort
    of the whole queue)."""
    other = _figures().alias("other")
    return (
        select(func.count())
        .where(other.c.queue == asked.c.queue, tuple_(*_fair_key(other)) <= tuple_(*_fair_key(asked)))
        .scalar_subquery()
    )


@cache
def _counted_positions() -> Select[Any]:
    """The asked jobs' positions, each counted (`_counted`)."""
    asked = _figures().alias("asked")
    return select(asked.c.job_id, _counted(asked)).where(
        asked.c.job_id.in_(bindparam("job_ids", expanding=True))
    )


def position_column() -> ColumnElement[int | None]:
    """A column for a select of `Job`: the job's queue position if it is queued, else NULL. A job's read
    selects it with the job, one statement (the read a polling dashboard makes most). The count alone
    would be NULL for a job that is not queued too; the CASE is there so that the database does not
    compute the queue's figures for it at all (EXPLAIN: "never executed")."""
    asked = _figures().alias("asked")
    counted = select(_counted(asked)).where(asked.c.job_id == Job.id).scalar_subquery()
    return case((Job.status == "queued", counted), else_=null())


@cache
def _ranked_positions() -> Select[Any]:
    """The asked jobs' positions from one rank of every queued job in its queue's fair order."""
    figures = _figures()
    position = func.row_number().over(partition_by=figures.c.queue, order_by=_fair_key(figures))
    ranked = select(figures.c.job_id, position.label("position")).subquery()
    return select(ranked.c.job_id, ranked.c.position).where(
        ranked.c.job_id.in_(bindparam("job_ids", expanding=True))
    )


def queue_positions(session: Session, job_ids: list[str]) -> dict[str, int]:
    """1-based positions, each in the fair order of its own queue, of those of `job_ids` that are
    queued. The database computes them (a queued job's read had fetched every queued job and sorted them
    in Python, most of the read's CPU with a thousand queued) and returns only the asked rows."""
    if not job_ids:
        return {}
    query = _counted_positions() if len(job_ids) <= _COUNTED_UP_TO else _ranked_positions()
    return {job_id: int(position) for job_id, position in session.execute(query, {"job_ids": job_ids})}


def position_if_queued_now(session: Session, *, tenant_id: str, queue: str, now: float) -> int:
    """The queue position a job of `tenant_id` created in `queue` at `now` would have (the pre-flight
    estimate): 1 + the queued jobs ahead of it in the fair order (a new id sorts after every other)."""
    waiting = fair_order(session, queues=[queue])
    mine = [w for w in waiting if w.tenant_id == tenant_id]
    running: int | None
    if mine:
        running, last = mine[0].tenant_running, mine[0].tenant_last_started
    else:
        running = session.scalar(
            select(func.count()).where(Job.tenant_id == tenant_id, Job.status == "running")
        )
        last = session.scalar(select(func.max(Job.started_at)).where(Job.tenant_id == tenant_id))
    new = (len(mine) + 1, int(running or 0), -1 if last is None else last, now)
    ahead = sum(
        1
        for w in waiting
        if (
            w.turn,
            w.tenant_running,
            -1 if w.tenant_last_started is None else w.tenant_last_started,
            w.queued_at or 0.0,
        )
        <= new
    )
    return ahead + 1
