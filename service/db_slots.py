"""Admission to the database pool, decided on the event loop before any thread is used.

Why: a request used to check a pooled connection out in one threadpool hop (the API-key lookup) and
keep it, idle in transaction, until its route ran in another hop. With more requests than pool slots,
every worker thread ended up blocked on the pool for a connection held by a request that was itself
waiting for a thread: at 200 connections one process served ~10 req/s, pool timeouts became errors
and even /healthz (a sync route then) hung behind them. Waiting here instead, on the event loop,
breaks that cycle: at most `db_pool_size` requests hold a slot, each slot is backed by a pooled
connection, and the threadpool has more threads than slots, so a thread never waits for a connection
and an admitted request never waits long for a thread. Requests beyond that queue here at no cost
(no thread, no connection) and are served in arrival order.

Every database user in the API process takes a slot: the request session (service.dependencies),
the SSE stream's reads, /readyz and /metrics. The pool keeps a few overflow connections for what
runs outside a request (the dispatch reconciler in an embedded server). A request that cannot get a
slot within `db_pool_timeout_seconds` (the pool's own checkout timeout, 10 s by default) is a 503 with
Retry-After, never a 500.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar

import anyio
import anyio.to_thread

from service.config import get_settings
from service.errors import ServiceUnavailable

# threads beyond the slots, for sync work that touches no database (blob reads and writes, upload
# parsing): with them a slot never sits idle for lack of a thread
SPARE_THREADS = 16

_slots: anyio.Semaphore | None = None
# whether the running task holds a slot
_holding: ContextVar[bool] = ContextVar("tunehouse_db_slot_held", default=False)


def _semaphore() -> anyio.Semaphore:
    global _slots
    if _slots is None:  # created on the server's event loop at the first request
        _slots = anyio.Semaphore(get_settings().db_pool_size)
    return _slots


def size_threadpool() -> None:
    """At startup: enough threads that every slot can run at once, plus the spares."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    limiter.total_tokens = max(limiter.total_tokens, get_settings().db_pool_size + SPARE_THREADS)


async def _wait_for_slot(slots: anyio.Semaphore) -> None:
    timeout = get_settings().db_pool_timeout_seconds
    try:
        # asyncio's timeout, not anyio's `fail_after`: beyond ~20 connections a process's requests mostly
        # wait here, and anyio's cancel scope cost nearly 3x asyncio's CPU per wait over a bare acquire
        # (500 waiters on 10 slots), ~8% of a job read's CPU at 1,000 connections in a profile. The
        # server's loop is asyncio's (uvloop) either way.
        async with asyncio.timeout(timeout):
            await slots.acquire()
    except TimeoutError as exc:
        raise ServiceUnavailable(
            f"The database is busy: no connection came free within {timeout:g} s; retry shortly.",
            code="database_busy",
        ) from exc


@asynccontextmanager
async def db_slot() -> AsyncIterator[None]:
    """Hold one of the pool's slots: the caller may then check a connection out without waiting.

    A request holds at most one: a read inside a request that holds a slot already (the API key's
    lookup under a route's session) uses it. Were it to wait for a second, requests holding every slot
    would each wait for another, and none would come free until the timeout. The slot stands for one
    connection of each pool (the request session's and the async reads'), both sized `db_pool_size`.
    """
    if _holding.get():
        yield
        return
    slots = _semaphore()
    try:
        # a free slot (the common case) is taken without a timeout's cancel scope: setting one up was
        # ~6% of a job read's CPU (git log -p docs/benchmarks.md). A semaphore with a free slot has no
        # waiters (a release hands the slot to the first waiter), so arrival order still holds.
        slots.acquire_nowait()
    except anyio.WouldBlock:
        await _wait_for_slot(slots)
    _holding.set(True)  # seen by what this task runs next (each request is a task of its own)
    try:
        yield
    finally:
        _holding.set(False)
        slots.release()
