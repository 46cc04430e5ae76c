"""A pooled connection whose server process is gone (a database restart, an administrator's
`pg_terminate_backend`) is replaced at checkout, so the next request succeeds; a healthy idle one is
reused as it is. The check reads the socket, not the database (service/db.py `server_hung_up`).

The backend is terminated for real, in the shared PostgreSQL: only the test's own connection goes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, text

from service.db import make_engine


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
