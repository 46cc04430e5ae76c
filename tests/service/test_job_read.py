"""A job's read, the call a polling dashboard makes most, on real PostgreSQL through the async driver
(service/dependencies.py `read_only`): one statement gives the job and its queue position, and it runs
outside a transaction block (no BEGIN and COMMIT round trips around it).

The rows sit in a queue of their own, so no worker claims them and no other test's jobs share their
positions.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any

from psycopg.pq import TransactionStatus
from sqlalchemy import event
from sqlalchemy.orm import Session

from service.db import dispose_async_engine, get_async_engine, get_async_sessionmaker, session_scope
from service.dependencies import read_only
from service.ids import new_id
from service.jobs import service
from service.jobs.fairness import queue_positions
from tests.helpers import job_row, new_tenant


def _read_each(tenant: Any, job_ids: list[str]) -> tuple[dict[str, int | None], list[str], set[Any]]:
    """Each job's position as its read gives it, the statements those reads sent, and the connection's
    transaction status after each read's statement."""
    statements: list[str] = []
    statuses: set[Any] = set()

    def read(session: Session, *, job_id: str) -> int | None:
        job, position = service.get_job_with_position(session, tenant=tenant, job_id=job_id)
        assert job.id == job_id
        driver = session.connection().connection.driver_connection
        assert driver is not None
        statuses.add(driver.info.transaction_status)
        return position

    async def main() -> dict[str, int | None]:
        engine = get_async_engine()
        assert engine is not None and get_async_sessionmaker() is not None
        record = lambda *args: statements.append(args[2])  # noqa: E731 (before_cursor_execute's statement)
        event.listen(engine.sync_engine, "before_cursor_execute", record)
        try:
            return {j: await read_only(partial(read, job_id=j)) for j in job_ids}
        finally:
            event.remove(engine.sync_engine, "before_cursor_execute", record)
            await dispose_async_engine()  # its connections belong to this test's event loop

    try:
        return asyncio.run(main()), statements, statuses
    finally:
        get_async_sessionmaker.cache_clear()
        get_async_engine.cache_clear()


def test_a_jobs_read_gives_its_queue_position_in_one_statement_outside_a_transaction() -> None:
    tenant = new_tenant("job-read")
    queue = f"test-job-read-{new_id('q')}"
    now = time.time()
    with session_scope() as session:
        queued = [job_row(tenant.id, queue=queue, queued_at=now + i) for i in range(3)]
        done = job_row(tenant.id, "succeeded", queue=queue, queued_at=now - 1)
        session.add_all([*queued, done])
    job_ids = [j.id for j in [*queued, done]]

    positions, statements, statuses = _read_each(tenant, job_ids)

    with session_scope() as session:
        expected = queue_positions(session, job_ids)
    assert positions == {queued[0].id: 1, queued[1].id: 2, queued[2].id: 3, done.id: None}
    assert {j: p for j, p in positions.items() if p is not None} == expected
    assert len(statements) == len(job_ids)  # one per read: the position comes with the job
    assert statuses == {TransactionStatus.IDLE}  # autocommit: no transaction left open to COMMIT
