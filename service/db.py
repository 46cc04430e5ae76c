"""Engine and sessions. One engine per process, created lazily from the settings."""

from __future__ import annotations

import select
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, sessionmaker

from service.config import get_settings

# The errors that mean "the database is unreachable", not "this statement is wrong": connection
# refused/reset (OperationalError), a dead connection (InterfaceError), no pooled connection free in
# time (TimeoutError), a pooled connection the server hung up on, each time (DisconnectionError).
DB_UNAVAILABLE_ERRORS: tuple[type[Exception], ...] = (
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.TimeoutError,
    sa_exc.DisconnectionError,
)


# a server that does not answer a connection attempt in this long is down (503), not slow
CONNECT_TIMEOUT_SECONDS = 5


def make_engine(url: str, *, pool_size: int = 10, max_overflow: int = 20) -> Engine:
    if url.startswith("sqlite"):
        db_file = url.split("///", 1)[-1]
        if db_file and db_file != ":memory:":
            Path(db_file).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            # WAL lets the API read while a worker writes metrics; busy_timeout rides out short locks.
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    # An unreachable database must fail a request in seconds (a 503 with Retry-After), not hang it:
    # connect_timeout bounds a connection attempt to a silent host, pool_timeout the wait for a free
    # connection. A pooled connection the server has hung up on (a restart) is replaced at checkout
    # (`_replace_if_hung_up`), so the API recovers by itself when the database is back. The API admits
    # at most pool_size requests to the database (service/db_slots.py); the overflow serves what runs
    # outside a request (reconciler, a failed send recorded at commit).
    engine = create_engine(url, **_server_pool(url, pool_size=pool_size, max_overflow=max_overflow))
    event.listen(engine, "checkout", _replace_if_hung_up)
    return engine


def _server_pool(url: str, *, pool_size: int, max_overflow: int) -> dict[str, Any]:
    """The pool options of a database server's engine, sync or async (see make_engine)."""
    return {
        "pool_size": pool_size,
        "max_overflow": max_overflow,
        "pool_timeout": get_settings().db_pool_timeout_seconds,
        "connect_args": {"connect_timeout": CONNECT_TIMEOUT_SECONDS} if url.startswith("postgresql") else {},
    }


def server_hung_up(dbapi_connection: Any) -> bool:
    """Whether the server has closed this idle psycopg connection (the sync pool's, or the API's read
    connections, service/db_reads.py), asked of the socket alone.

    Between requests nothing is owed on a pooled connection, so its socket has something to read only
    when the server spoke unasked: the notice a backend sends as it is terminated, or the end of the
    stream when the server (or its host) went away. (Any other unasked message costs one needless
    reconnect, nothing worse.) `pool_pre_ping` found the same with a `SELECT 1` round trip per
    checkout: a fifth of the client CPU that reading one queued job took
    (git log -p docs/benchmarks.md).
    """
    if dbapi_connection.closed or dbapi_connection.broken:
        return True
    readable, _, _ = select.select([dbapi_connection.fileno()], [], [], 0)
    return bool(readable)


def _replace_if_hung_up(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
    # DisconnectionError at checkout: the pool discards this connection and checks out another
    # (SQLAlchemy's documented custom pessimistic disconnect handling)
    if server_hung_up(dbapi_connection):
        raise sa_exc.DisconnectionError("the database server closed this pooled connection")


@lru_cache
def get_engine() -> Engine:
    settings = get_settings()
    return make_engine(
        settings.database_url, pool_size=settings.db_pool_size, max_overflow=settings.db_max_overflow
    )


@lru_cache
def get_sessionmaker() -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(), expire_on_commit=False)


@contextmanager
def session_scope() -> Iterator[Session]:
    """A session that commits on success and rolls back on error (workers, CLI)."""
    session = get_sessionmaker()()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
