"""Shared fixtures: a real PostgreSQL database, real Redis, real uvicorn servers and a real Celery worker.

The environment is set here, before anything imports `service.config`, so this process and every
child process (servers, worker, trainer) agree on one database, one broker and one blob folder.
Override the targets with TUNEHOUSE_TEST_POSTGRES (a server URL without database) and
TUNEHOUSE_TEST_REDIS. There is no fallback: if they are down, the suite fails and says so.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

PG_SERVER = os.environ.get("TUNEHOUSE_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432")
PG_DATABASE = f"tunehouse_test_{os.getpid()}"
REDIS = os.environ.get("TUNEHOUSE_TEST_REDIS", "redis://127.0.0.1:6379")
# the worker stack listens on db 15; the API-only server sends to db 14, where no worker listens,
# so API tests can create jobs without training them
WORKER_BROKER = f"{REDIS}/15"
IDLE_BROKER = f"{REDIS}/14"
DATA_DIR = Path(tempfile.mkdtemp(prefix="tunehouse-test-"))
MAX_UPLOAD_BYTES = 2 * 1024 * 1024

os.environ.update(
    {
        "TUNEHOUSE_DATABASE_URL": f"{PG_SERVER}/{PG_DATABASE}",
        "TUNEHOUSE_BROKER_URL": WORKER_BROKER,
        "TUNEHOUSE_REDIS_URL": f"{REDIS}/13",
        "TUNEHOUSE_DATA_DIR": str(DATA_DIR),
        "TUNEHOUSE_MAX_UPLOAD_BYTES": str(MAX_UPLOAD_BYTES),
        "TUNEHOUSE_HEARTBEAT_SECONDS": "1",
        "TUNEHOUSE_LEASE_TIMEOUT_SECONDS": "10",
        "TUNEHOUSE_CONTROL_POLL_SECONDS": "0.2",
        "TOKENIZERS_PARALLELISM": "false",
        "TUNEHOUSE_LOG_LEVEL": "WARNING",
        "HF_HUB_OFFLINE": "1",
    }
)


def _require_services() -> None:
    import redis
    from sqlalchemy import create_engine, text

    try:
        engine = create_engine(f"{PG_SERVER}/postgres", isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{PG_DATABASE}"'))
            conn.execute(text(f'CREATE DATABASE "{PG_DATABASE}"'))
        engine.dispose()
    except Exception as exc:
        pytest.exit(
            f"PostgreSQL is not reachable at {PG_SERVER}: {exc}. Start it (see .ci/run).", returncode=3
        )
    try:
        for db in (13, 14, 15):
            redis.Redis.from_url(f"{REDIS}/{db}").flushdb()
    except Exception as exc:
        pytest.exit(f"Redis is not reachable at {REDIS}: {exc}. Start it (see .ci/run).", returncode=3)


def pytest_sessionstart(session: pytest.Session) -> None:
    _require_services()
    from service.config import get_settings
    from service.migrate import upgrade_head

    upgrade_head(get_settings().database_url)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from sqlalchemy import create_engine, text

    from service.db import get_engine

    get_engine().dispose()
    engine = create_engine(f"{PG_SERVER}/postgres", isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{PG_DATABASE}" WITH (FORCE)'))
    engine.dispose()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_server(env_overrides: dict[str, str]) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    env = {**os.environ, **env_overrides}
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "service.app:app", "--port", str(port), "--log-level", "warning"],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/readyz", proc)
    return url, proc


@pytest.fixture(scope="session")
def api_url() -> Iterator[str]:
    """A real uvicorn server whose broker has no worker: jobs stay queued."""
    url, proc = start_server({"TUNEHOUSE_BROKER_URL": IDLE_BROKER})
    yield url
    _stop(proc)


@dataclass
class Stack:
    url: str
    worker: subprocess.Popen[bytes]


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """API server + one Celery worker over Redis + PostgreSQL: jobs really train."""
    url, server = start_server({"TUNEHOUSE_BROKER_URL": WORKER_BROKER})
    worker = subprocess.Popen(
        [sys.executable, "-m", "tunehouse.cli", "worker", "--loglevel", "warning"],
        env={**os.environ, "TUNEHOUSE_BROKER_URL": WORKER_BROKER},
    )
    yield Stack(url=url, worker=worker)
    _stop(worker)
    _stop(server)


def new_key(tenant: str | None = None) -> str:
    from service.auth import create_api_key
    from service.db import session_scope

    with session_scope() as session:
        _, key = create_api_key(session, tenant_name=tenant or f"tenant-{os.urandom(6).hex()}")
    return key


@pytest.fixture
def api_key() -> str:
    return new_key()


@pytest.fixture
def client(api_url: str, api_key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60) as c:
        yield c


@pytest.fixture
def stack_client(stack: Stack, api_key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60) as c:
        yield c
