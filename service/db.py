"""Engine and sessions. One engine per process, created lazily from the settings."""

from __future__ import annotations

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
# time (TimeoutError), a connection invalidated by pre-ping (DisconnectionError).
DB_UNAVAILABLE_ERRORS: tuple[type[Exception], ...] = (
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.TimeoutError,
    sa_exc.DisconnectionError,
)


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
    # connection. pre_ping replaces connections that died with a database restart, so the API recovers
    # by itself when the database is back. The API admits at most pool_size requests to the database
    # (service/db_slots.py); the overflow serves what runs outside a request (reconciler, a failed
    # send recorded at commit).
    connect_args = {"connect_timeout": 5} if url.startswith("postgresql") else {}
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout=get_settings().db_pool_timeout_seconds,
        connect_args=connect_args,
    )


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
