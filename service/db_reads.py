"""The API's hottest reads on psycopg's async connections directly, with no SQLAlchemy engine between:
a job's read, and an API key's lookup when the key is not cached (service/auth.py).

Why: a job's read is the call a dashboard fleet makes most (bench/test_api_throughput.py). Through
SQLAlchemy's async engine, which the API used until then, its one statement cost the app about 2.5x
the CPU it costs on a psycopg connection kept here: the pool's checkout, the greenlet that adapts the
async driver, the result's processing (git log -p docs/benchmarks.md). The statement is still built
with SQLAlchemy, and compiled once per process (`CompiledRead`).

What SQLAlchemy's pool did for these reads is done here too: a connection the server hung up on is
replaced at checkout (`service.db.server_hung_up`), a connection whose read failed or was cancelled
is closed rather than reused, and the connections are closed at the API's shutdown. They autocommit:
a read of one statement needs no transaction around it, and a BEGIN and a COMMIT were half the
database's CPU for a job's read (git log -p docs/benchmarks.md). How many are in use at once is bounded by the
caller's database slot (service/db_slots.py), how many are kept idle by `db_pool_size`. PostgreSQL
only: on SQLite `read_connections` is None and the caller reads in a thread.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from typing import Any

import anyio
import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import Select, TextClause
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql.psycopg import PGDialectAsync_psycopg
from sqlalchemy.engine import make_url

from service.config import get_settings
from service.db import CONNECT_TIMEOUT_SECONDS, server_hung_up

# A row of a read: its fields are the statement's column labels, read as attributes (a psycopg
# named tuple here, SQLAlchemy's Row where the caller read in a thread). Neither has a static type
# that names its fields.
ReadRow = Any


class CompiledRead:
    """A Core statement compiled once for psycopg: its SQL and the constants it binds. The values it
    leaves to execution (`bindparam`s without a value) are given to `ReadConnections.first`."""

    def __init__(self, statement: Select[*tuple[Any, ...]] | TextClause) -> None:
        self.statement = statement  # as it is, for SQLite's reads in a thread
        compiled = statement.compile(dialect=PGDialectAsync_psycopg())  # type: ignore[no-untyped-call]
        self.sql = str(compiled)
        self.constants = dict(compiled.params)


class ReadConnections:
    """psycopg async connections of one event loop, reused last-in first-out (the warmest first)."""

    def __init__(self, conninfo: str, keep: int) -> None:
        self.loop = asyncio.get_running_loop()
        self._conninfo = conninfo
        self._keep = keep
        self._idle: deque[psycopg.AsyncConnection[Any]] = deque()

    async def first(self, read: CompiledRead, params: Mapping[str, Any]) -> ReadRow | None:
        sql = read.sql
        bound = {**read.constants, **params}
        try:
            connection = await self._checkout()
            try:
                cursor = await connection.execute(sql, bound)
                row = await cursor.fetchone()
            except BaseException:
                # failed or cancelled mid-read: what the connection still owes the server is unknown
                with anyio.CancelScope(shield=True):
                    await connection.close()
                raise
        except psycopg.Error as exc:
            # as SQLAlchemy's class for it (OperationalError when the server is down or gone), which
            # the API answers 503 with Retry-After (service.db.DB_UNAVAILABLE_ERRORS)
            raise sa_exc.DBAPIError.instance(sql, bound, exc, psycopg.Error) from exc
        await self._checkin(connection)
        return row

    async def _checkout(self) -> psycopg.AsyncConnection[Any]:
        while self._idle:
            connection = self._idle.pop()
            if not server_hung_up(connection):
                return connection
            await connection.close()
        return await psycopg.AsyncConnection.connect(
            self._conninfo,
            autocommit=True,
            row_factory=namedtuple_row,
            connect_timeout=CONNECT_TIMEOUT_SECONDS,
        )

    async def _checkin(self, connection: psycopg.AsyncConnection[Any]) -> None:
        if len(self._idle) < self._keep and not connection.broken:
            self._idle.append(connection)
        else:
            await connection.close()

    async def close(self) -> None:
        while self._idle:
            await self._idle.pop().close()


_current: ReadConnections | None = None


def read_connections() -> ReadConnections | None:
    """This event loop's read connections; None where the database is not PostgreSQL. A server runs
    one loop; a test that starts another gets fresh connections (those of a finished loop cannot be
    awaited on)."""
    global _current
    settings = get_settings()
    if not settings.database_url.startswith("postgresql+psycopg"):
        return None
    if _current is None or _current.loop is not asyncio.get_running_loop():
        conninfo = make_url(settings.database_url).set(drivername="postgresql")
        _current = ReadConnections(conninfo.render_as_string(hide_password=False), settings.db_pool_size)
    return _current


async def close_read_connections() -> None:
    """At the API's shutdown, on the loop that opened them."""
    if _current is not None and _current.loop is asyncio.get_running_loop():
        await _current.close()
