"""More requests than pooled connections: they queue for a database slot on the event loop
(service/db_slots.py) instead of blocking threads, so they all succeed, /healthz answers meanwhile, and
a request that cannot get a connection in time is a 503 with Retry-After, never a 500.

The database is made to hold its connections for real: the test process takes an exclusive lock on
the `jobs` table, so every admitted `GET /v1/fine_tuning/jobs/{id}` waits inside PostgreSQL holding
its pooled connection, as a slow query would. Servers are real uvicorn processes with a pool of 1-2.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from sqlalchemy import text

from service.db import get_engine
from tests.conftest import IDLE, _stop, new_key, start_server
from tests.helpers import chat_rows, upload_ok

# more than the threadpool's 40 threads: before admission, this many requests blocked every thread on
# the pool and nothing (/healthz included) was served until the pool timeout turned them into errors
CONCURRENT = 60


@contextmanager
def jobs_table_locked() -> Iterator[None]:
    with get_engine().connect() as conn:
        conn.execute(text("SET lock_timeout = '10s'"))
        conn.execute(text("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE"))
        try:
            yield
        finally:
            conn.rollback()


@contextmanager
def server(pool_size: int, pool_timeout: float, auth_cache: float = 5.0) -> Iterator[tuple[str, str]]:
    url, proc = start_server(
        {
            **IDLE,
            "TUNEHOUSE_DB_POOL_SIZE": str(pool_size),
            "TUNEHOUSE_DB_POOL_TIMEOUT_SECONDS": str(pool_timeout),
            "TUNEHOUSE_AUTH_CACHE_SECONDS": str(auth_cache),
        }
    )
    try:
        key = new_key()
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
            file_id = upload_ok(client, chat_rows(4))
            created = client.post(
                "/v1/fine_tuning/jobs", json={"model": "tunehouse/tiny-llama", "training_file": file_id}
            )
            assert created.status_code == 200, created.text
        yield f"{url}/v1/fine_tuning/jobs/{created.json()['id']}", key
    finally:
        _stop(proc)


async def _burst(job_url: str, key: str, n: int, *, while_locked: float) -> list[httpx.Response]:
    """`n` concurrent GETs of the job sent while the jobs table is locked for `while_locked` seconds;
    /healthz must answer (fast) before the lock is released."""
    limits = httpx.Limits(max_connections=n + 1)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        headers = {"Authorization": f"Bearer {key}"}
        gets = [asyncio.create_task(client.get(job_url, headers=headers)) for _ in range(n)]
        await asyncio.sleep(min(1.0, while_locked / 2))  # the requests are in: slots taken, rest queued
        assert not any(g.done() and g.result().status_code == 200 for g in gets), "the lock held nothing"
        base = job_url.split("/v1/")[0]
        started = time.monotonic()
        health = await client.get(f"{base}/healthz", timeout=15)
        assert health.status_code == 200 and time.monotonic() - started < 10, "/healthz waited on the pool"
        await asyncio.sleep(max(0.0, while_locked - (time.monotonic() - started)))
        return await asyncio.gather(*gets)


def _run_locked(job_url: str, key: str, n: int, seconds: float) -> list[httpx.Response]:
    with jobs_table_locked():
        loop = asyncio.new_event_loop()
        try:
            burst = loop.create_task(_burst(job_url, key, n, while_locked=seconds))
            # release the lock from here once the burst's lock window is over, then collect
            loop.run_until_complete(asyncio.sleep(seconds + 0.5))
        except BaseException:
            loop.close()
            raise
    try:
        return loop.run_until_complete(burst)
    finally:
        loop.close()


def test_requests_beyond_the_pool_queue_and_all_succeed_while_healthz_answers() -> None:
    # No key cache: every request reads its key, then its job, each read holding a slot while it runs.
    # Before admission, threads blocked on the pool for connections held by requests waiting for
    # threads; a slot held across both reads would deadlock the slots the same way. Either way the
    # requests fail at the (generous) timeout; with admission the burst is served once the lock goes.
    with server(pool_size=2, pool_timeout=20, auth_cache=0) as (job_url, key):
        answers = _run_locked(job_url, key, CONCURRENT, seconds=3.0)
        statuses = [r.status_code for r in answers]
        assert statuses == [200] * CONCURRENT, sorted(set(statuses))
        assert {r.json()["id"] for r in answers} == {job_url.rsplit("/", 1)[1]}


def test_no_connection_in_time_is_503_with_retry_after_never_500() -> None:
    with server(pool_size=1, pool_timeout=1) as (job_url, key):
        answers = _run_locked(job_url, key, 5, seconds=4.0)
    statuses = sorted(r.status_code for r in answers)
    # the one admitted request waited in PostgreSQL and got its answer; the rest gave up after 1 s
    assert statuses == [200, 503, 503, 503, 503], statuses
    for busy in (r for r in answers if r.status_code == 503):
        assert int(busy.headers["retry-after"]) > 0
        error = busy.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "database_busy", error
