"""Migrations match the models on an empty PostgreSQL and on SQLite; commit-then-enqueue holds."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import create_engine, text

from service import queue
from service.db import get_sessionmaker
from service.migrate import alembic_config, upgrade_head
from service.models import Tenant
from tests.conftest import PG_SERVER


@pytest.fixture
def empty_pg() -> Iterator[str]:
    name = f"tunehouse_migr_{os.getpid()}"
    admin = create_engine(f"{PG_SERVER}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield f"{PG_SERVER}/{name}"
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def test_upgrade_head_on_empty_postgres_matches_models(empty_pg: str) -> None:
    upgrade_head(empty_pg)
    command.check(alembic_config(empty_pg))  # raises if autogenerate finds a difference


def test_upgrade_head_on_sqlite_matches_models(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade_head(url)
    command.check(alembic_config(url))


def test_task_is_sent_after_commit_and_dropped_on_rollback(
    idle_broker: Callable[[], list[tuple[str, list[Any]]]],
) -> None:
    tag = os.urandom(4).hex()  # other tests' jobs also wait on the idle broker

    def mine() -> list[tuple[str, list[Any]]]:
        return [(name, args) for name, args in idle_broker() if str(args[0]).endswith(tag)]

    session = get_sessionmaker()()
    session.add(Tenant(id=f"tenant-rollback-{tag}", name=f"rollback-{tag}"))
    queue.enqueue_after_commit(session, "t", [f"tenant-rollback-{tag}"])
    session.flush()
    assert mine() == []  # flushed, not committed: nothing on the broker
    session.rollback()
    assert mine() == []
    # the same session carries on: its next commit sends what was enqueued since, not the rolled-back task
    session.add(Tenant(id=f"tenant-commit-{tag}", name=f"commit-{tag}"))
    queue.enqueue_after_commit(session, "t", [f"tenant-commit-{tag}"])
    session.flush()
    assert mine() == []
    session.commit()
    session.close()
    assert mine() == [("t", [f"tenant-commit-{tag}"])]  # on the real broker once committed
    with get_sessionmaker()() as other:  # and the row it names is visible to any other connection
        assert other.get(Tenant, f"tenant-commit-{tag}") is not None
