"""The fault harness itself: a private PostgreSQL and Redis survive stop/start on the same port and
data dir, and leave no process behind."""

from __future__ import annotations

import os

import httpx
import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from tests.faults.servers import FaultStack, postgres_server, redis_server


def test_postgres_restarts_with_its_data() -> None:
    with postgres_server() as pg:
        assert pg.port != 5432
        engine = create_engine(pg.url, pool_pre_ping=True)
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE probe (x int)"))
            conn.execute(text("INSERT INTO probe VALUES (7)"))
        pid = pg.pid
        assert pid is not None
        pg.stop()
        with pytest.raises(OperationalError), engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        pg.start()
        with engine.connect() as conn:
            assert conn.execute(text("SELECT x FROM probe")).scalar() == 7
        engine.dispose()
        root = pg.root
    assert not root.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_redis_restarts_on_its_port_and_forgets() -> None:
    with redis_server() as rds:
        client = redis.Redis.from_url(rds.url)
        client.set("k", "v")
        rds.stop()
        with pytest.raises(redis.ConnectionError):
            client.ping()
        rds.start()
        assert client.ping()
        assert client.get("k") is None  # no persistence: a restart loses what was queued
        client.close()
        proc = rds.proc
        assert proc is not None
    assert proc.poll() is not None


def test_stack_serves_from_its_own_database(fault_stack: FaultStack) -> None:
    url, _ = fault_stack.start_api()
    worker = fault_stack.start_worker()
    key = fault_stack.new_key()
    response = httpx.get(f"{url}/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    # the key lives in the private database only: the suite's shared server does not know it
    assert new_key_is_unknown_to_shared_db(key)
    fault_stack.stop(worker)
    assert worker.returncode is not None


def new_key_is_unknown_to_shared_db(key: str) -> bool:
    from service.auth import tenant_for_key
    from service.db import session_scope

    with session_scope() as session:
        return tenant_for_key(session, key) is None
