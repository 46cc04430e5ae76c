"""Fixtures for fault tests: a private PostgreSQL and Redis per test, and a stack wired to them.

Each test may stop, restart or kill these; the suite's shared servers are never touched.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.servers import FaultStack, PostgresServer, RedisServer, postgres_server, redis_server


@pytest.fixture
def own_pg() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture
def fault_stack(own_pg: PostgresServer, own_redis: RedisServer, tmp_path: Path) -> Iterator[FaultStack]:
    """Nothing started yet: the test starts the API and workers it needs (`start_api`, `start_worker`)."""
    stack = FaultStack(pg=own_pg, redis=own_redis, data_dir=tmp_path / "data")
    try:
        yield stack
    finally:
        stack.close()
