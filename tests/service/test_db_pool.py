"""A pooled connection whose server process is gone (a database restart, an administrator's
`pg_terminate_backend`) is replaced at checkout, so the next request succeeds; a healthy idle one is
reused as it is. The check reads the socket, not the database (service/db.py `server_hung_up`).
The same holds for the connections the API's hottest reads keep outside SQLAlchemy's pool
(service/db_reads.py), and a read that failed leaves its connection closed, its error in
SQLAlchemy's class (which the API maps to its answer: a 503 when the database is down).

The backend is terminated for real, in the shared PostgreSQL: only the test's own connection goes.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy import exc as sa_exc

from service.db import make_engine
from service.db_reads import CompiledRead, close_read_connections
from service.dependencies import read_row

T = TypeVar("T")
_PID = CompiledRead(select(func.pg_backend_pid().label("pid")))


@pytest.fixture
def engine() -> Iterator[Engine]:
    # one pooled connection and no overflow: every checkout gets the same one unless it is replaced
    engine = make_engine(os.environ["TUNEHOUSE_DATABASE_URL"], pool_size=1, max_overflow=0)
    yield engine
    engine.dispose()


def _backend_pid(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _terminate(pid: int) -> None:
    admin = create_engine(os.environ["TUNEHOUSE_DATABASE_URL"], isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar_one()
            deadline = time.monotonic() + 10
            gone = text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid")
            while conn.execute(gone, {"pid": pid}).scalar_one():
                assert time.monotonic() < deadline, f"backend {pid} did not exit"
                time.sleep(0.02)
    finally:
        admin.dispose()


def test_a_healthy_idle_connection_is_reused(engine: Engine) -> None:
    assert _backend_pid(engine) == _backend_pid(engine)


def test_a_connection_the_server_closed_is_replaced_at_checkout(engine: Engine) -> None:
    before = _backend_pid(engine)
    _terminate(before)
    after = _backend_pid(engine)  # without the check, this query fails on the dead connection
    assert after != before
    assert _backend_pid(engine) == after  # and the new one is kept


def _on_read_connections(work: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        try:
            return await work()
        finally:
            await close_read_connections()  # they belong to this test's event loop

    return asyncio.run(main())


async def _read_pid() -> int:
    row = await read_row(_PID, {})
    assert row is not None
    return int(row.pid)


def test_a_read_connection_the_server_closed_is_replaced_at_checkout() -> None:
    async def work() -> tuple[int, int, int]:
        before = await _read_pid()
        _terminate(before)
        after = await _read_pid()  # without the check, this read fails on the dead connection
        return before, after, await _read_pid()

    before, after, again = _on_read_connections(work)
    assert after != before
    assert again == after  # and the new one is kept


def test_a_failed_read_raises_sqlalchemys_error_and_its_connection_is_not_reused() -> None:
    async def work() -> tuple[int, int]:
        before = await _read_pid()
        with pytest.raises(sa_exc.DataError, match="division by zero"):
            await read_row(CompiledRead(text("SELECT 1 / 0 AS quotient")), {})
        return before, await _read_pid()

    before, after = _on_read_connections(work)
    assert after != before
