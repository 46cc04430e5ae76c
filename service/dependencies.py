"""Request-scoped dependencies as `Annotated` aliases.

The request session is an async dependency on purpose: it waits for a database slot on the event loop
(service/db_slots.py) and creates the session there (no I/O: the connection is checked out by the
first query, in the same threadpool hop as the route's work); only the commit takes a thread.
Dependencies that do no I/O are `async def` too, so they cost no threadpool hop.

`read_row` is the path of the hot reads (a job's read, a key's tenant when it is not cached): no
request session and no thread; the read runs on the event loop on psycopg's async connections
(service/db_reads.py) and holds a slot only while it reads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any

import anyio
from fastapi import Depends, Query, Request
from sqlalchemy import Executable, Row
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.config import Settings, get_settings
from service.db import get_sessionmaker, session_scope
from service.db_reads import CompiledRead, ReadRow, read_connections
from service.db_slots import db_slot
from service.errors import BadRequest
from service.input_guard import text_problem
from service.pagination import MAX_LIMIT


def _commit(session: Session) -> None:
    try:
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


# a list's `limit` and `after` query parameters: bounded in the signature, so OpenAPI documents the
# range (service/pagination.py pages with them)
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT)]
# the id of the last object of the previous page (ids are at most 40 characters)
After = Annotated[str | None, Query(min_length=1, max_length=64)]


def _first_row_in_thread(statement: Executable, params: Mapping[str, Any]) -> Row[Any] | None:
    with session_scope() as session:
        return session.execute(statement, params).first()


async def read_row(read: CompiledRead, params: Mapping[str, Any]) -> ReadRow | None:
    """For the hottest `async def` read routes: one Core statement's first row, on the event loop
    straight through psycopg (service/db_reads.py; in a thread on SQLite), holding a slot only while
    it reads. No ORM session, no mapped objects, no SQLAlchemy engine: a job's read costs the app
    about 2.5x less CPU than through the async engine (git log -p docs/benchmarks.md)."""
    async with db_slot():
        connections = read_connections()
        if connections is None:
            return await run_in_threadpool(_first_row_in_thread, read.statement, params)
        return await connections.first(read, params)


def _rollback(session: Session) -> None:
    try:
        session.rollback()
    finally:
        session.close()


async def _session() -> AsyncIterator[Session]:
    # Commit after the route function returns but before the response is sent (scope="function"),
    # so a client never sees 200 for something that was not stored. Tasks queued during the request
    # are sent by service.queue only after this commit, and dropped on rollback.
    async with db_slot():
        session = get_sessionmaker()()
        try:
            yield session
        except BaseException:
            with anyio.CancelScope(shield=True):  # a disconnected client must not leak the connection
                await run_in_threadpool(_rollback, session)
            raise
        if not session.in_transaction():  # the route used no database: nothing to send, no thread needed
            session.close()
            return
        with anyio.CancelScope(shield=True):
            await run_in_threadpool(_commit, session)


async def _settings() -> Settings:
    return get_settings()


SessionDep = Annotated[Session, Depends(_session, scope="function")]
SettingsDep = Annotated[Settings, Depends(_settings)]


async def reject_unsafe_url(request: Request) -> None:
    """App-wide: path and query parameters reach text columns too (a NUL there is a 400, not a 500)."""
    for name, raw in [*request.path_params.items(), *request.query_params.multi_items()]:
        problem = text_problem(str(name)) or text_problem(str(raw))
        if problem:
            raise BadRequest(f"{name}: {problem}", param=name, code="invalid_value")
