"""Migrations match the models on an empty PostgreSQL and on SQLite; commit-then-enqueue holds."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import create_engine, text

from service import queue
from service.db import get_sessionmaker, session_scope
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


def test_task_is_sent_after_commit_and_dropped_on_rollback(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[str, list[Any], bool]] = []

    def record(name: str, args: list[Any]) -> None:
        # at send time the row must already be visible to another connection
        with get_sessionmaker()() as other:
            sent.append((name, args, other.get(Tenant, args[0]) is not None))

    monkeypatch.setattr(queue, "send_task", record)

    session = get_sessionmaker()()
    session.add(Tenant(id="tenant-rollback", name="rollback-test"))
    queue.enqueue_after_commit(session, "t", ["tenant-rollback"])
    session.flush()
    assert sent == []
    session.rollback()
    session.close()
    assert sent == []

    with session_scope() as s:
        s.add(Tenant(id="tenant-commit", name="commit-test"))
        queue.enqueue_after_commit(s, "t", ["tenant-commit"])
        assert sent == []
    assert sent == [("t", ["tenant-commit"], True)]
