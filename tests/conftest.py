"""Shared fixtures: a real PostgreSQL database, real Redis, real uvicorn servers and a real Celery worker.

The environment is set here, before anything imports `service.config`, so this process and every
child process (servers, worker, trainer) agree on one database, one broker and one blob folder.
Override the targets with TUNEHOUSE_TEST_POSTGRES (a server URL without database) and
TUNEHOUSE_TEST_REDIS. There is no fallback: if they are down, the suite fails and says so.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

PG_SERVER = os.environ.get("TUNEHOUSE_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432")
PG_DATABASE = f"tunehouse_test_{os.getpid()}"
REDIS = os.environ.get("TUNEHOUSE_TEST_REDIS", "redis://127.0.0.1:6379")
# `make test` runs the suite in parallel processes (pytest-xdist): each has its own database (above, by
# pid), blob folder and five Redis databases of its own (gw0: 15..11, gw1: 10..6, gw2: 5..1)
XDIST_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
if XDIST_WORKER > 2:
    raise RuntimeError("at most 3 pytest-xdist workers: Redis has 16 databases, each worker takes 5")
# One OpenMP thread for torch in each test process and every process it starts (servers, workers,
# trainers), unless the caller set a count: with three test processes on two cores, each torch process
# spinning two threads wasted half the CPU on contention (the trainer and family tests: 227 s of CPU and
# 139 s of wall time with the default, 118 s and 88 s with one thread). Only under xdist: a benchmark
# (bench/ reuses these fixtures in one process) keeps torch's default.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def redis_db(n: int) -> str:
    """This test process's n-th Redis database (n from 0 to 4): one no other test process uses."""
    assert 0 <= n <= 4
    return f"{REDIS}/{15 - 5 * XDIST_WORKER - n}"


# the worker stack listens on db 0; the API-only server sends to db 1, where no worker listens,
# so API tests can create jobs without training them; tests with stacks of their own take 3 and 4
WORKER_BROKER = redis_db(0)
IDLE_BROKER = redis_db(1)
# ... and to a queue of its own: a worker claims any queued job of the queue it consumes (the fair
# share, service/jobs/fairness.py), so the API-only jobs in the shared database must be in another
IDLE_QUEUE = "tunehouse-idle"
IDLE = {"TUNEHOUSE_BROKER_URL": IDLE_BROKER, "TUNEHOUSE_JOB_QUEUE": IDLE_QUEUE}
DATA_DIR = Path(tempfile.mkdtemp(prefix="tunehouse-test-"))
MAX_UPLOAD_BYTES = 2 * 1024 * 1024
# a base model in the operator's registry: the tiny Qwen3 of tests/model_families.py (Qwen3's real chat
# template, TRL's copy): the stacks train and estimate chat rows with tools and reasoning on it
CHAT_MODEL = "tunehouse/tiny-qwen3-chat"
CHAT_MODEL_DIR = DATA_DIR / "models" / "tiny-qwen3-chat"
# tiny vision-language bases of the families tests/vision_families.py builds (by `vision_models`)
VISION_MODELS = {
    "gemma3": "tunehouse/tiny-gemma3-vision",
    "idefics3": "tunehouse/tiny-idefics3-vision",
    "qwen2_5_vl": "tunehouse/tiny-qwen2_5_vl-vision",
}
VISION_MODEL_DIRS = {
    family: DATA_DIR / "models" / name.split("/")[1] for family, name in VISION_MODELS.items()
}
METRICS_TOKEN = "test-operator-token"

os.environ.update(
    {
        "TUNEHOUSE_DATABASE_URL": f"{PG_SERVER}/{PG_DATABASE}",
        "TUNEHOUSE_BROKER_URL": WORKER_BROKER,
        "TUNEHOUSE_REDIS_URL": redis_db(2),
        "TUNEHOUSE_DATA_DIR": str(DATA_DIR),
        "TUNEHOUSE_MAX_UPLOAD_BYTES": str(MAX_UPLOAD_BYTES),
        "TUNEHOUSE_METRICS_TOKEN": METRICS_TOKEN,
        "TUNEHOUSE_MODEL_REGISTRY": json.dumps(
            {
                CHAT_MODEL: str(CHAT_MODEL_DIR),
                **{VISION_MODELS[f]: str(VISION_MODEL_DIRS[f]) for f in VISION_MODELS},
            }
        ),
        "TUNEHOUSE_HEARTBEAT_SECONDS": "1",
        "TUNEHOUSE_LEASE_TIMEOUT_SECONDS": "10",
        "TUNEHOUSE_CONTROL_POLL_SECONDS": "0.2",
        # The API-only server's jobs must stay queued, but they share this database with the workers,
        # whose reconcilers would re-send them to a live broker after the (60 s) dispatch timeout.
        # Tests of the reconciler set their own (tests/e2e/test_job_recovery.py).
        "TUNEHOUSE_DISPATCH_TIMEOUT_SECONDS": "86400",
        # webhook retries in a fraction of a second (0.3, 0.6 s), 3 attempts at most, polled 5x a second
        "TUNEHOUSE_WEBHOOK_BACKOFF_SECONDS": "0.3",
        "TUNEHOUSE_WEBHOOK_MAX_ATTEMPTS": "3",
        "TUNEHOUSE_WEBHOOK_POLL_SECONDS": "0.2",
        "TUNEHOUSE_WEBHOOK_TIMEOUT_SECONDS": "5",
        "TOKENIZERS_PARALLELISM": "false",
        "TUNEHOUSE_LOG_LEVEL": "WARNING",
        "HF_HUB_OFFLINE": "1",
        # nothing outside is reachable: W&B integrations log to offline run files (W&B's own offline
        # mode, the one stand-in for its cloud), which tests/e2e/test_trackers.py reads back
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
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
        for n in range(5):
            redis.Redis.from_url(redis_db(n)).flushdb()
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


def start_server(
    env_overrides: dict[str, str], port: int | None = None, *, workers: int = 1
) -> tuple[str, subprocess.Popen[bytes]]:
    port = port or free_port()
    env = {**os.environ, **env_overrides}
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "service.app:app",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    if workers > 1:  # uvicorn's supervisor and that many server processes
        command += ["--workers", str(workers)]
    proc = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/readyz", proc)
    return url, proc


@pytest.fixture(scope="session")
def chat_model() -> str:
    """``CHAT_MODEL`` built: the tiny Qwen3 of tests/model_families.py, its real chat template and special
    tokens (its name, for job bodies)."""
    if not (CHAT_MODEL_DIR / "config.json").exists():
        from tests.model_families import build_family

        build_family("qwen3", CHAT_MODEL_DIR)
    return CHAT_MODEL


@pytest.fixture(scope="session")
def vision_models() -> dict[str, Path]:
    """The tiny vision-language bases (``VISION_MODELS``), built once per test process: family -> folder."""
    from tests.vision_families import build

    return {family: build(family, folder) for family, folder in VISION_MODEL_DIRS.items()}


@pytest.fixture(scope="session")
def api_url() -> Iterator[str]:
    """A real uvicorn server whose broker has no worker: jobs stay queued."""
    # no inference worker either: a request to try a model gets its 503 after 1 s, not the default 120
    url, proc = start_server({**IDLE, "TUNEHOUSE_INFERENCE_TIMEOUT_SECONDS": "1"})
    yield url
    _stop(proc)


@pytest.fixture(scope="session")
def family_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``family_model(name)``: the folder of family ``name``'s tiny model with its real chat template
    (``tests.model_families.FAMILIES``), built on first use, once per test process."""
    import functools

    from tests.model_families import build_family

    root = tmp_path_factory.mktemp("families")

    @functools.cache
    def build(name: str) -> Path:
        return build_family(name, root / name)

    return build


@pytest.fixture(scope="module")
def module_database(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh, migrated database of this test module's own (``tests.helpers.own_database``)."""
    from tests.helpers import own_database

    with own_database(request.module.__name__.rsplit(".", 1)[-1]) as sessions:
        yield sessions


@pytest.fixture
def use_module_database(module_database: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every ``session_scope()`` of the test opens a session on the module's own database: for in-process
    tests of rows the e2e stack's worker must not see (its reconciler and claims would race them)."""
    import service.db

    monkeypatch.setattr(service.db, "get_sessionmaker", lambda: module_database)
    return module_database


@pytest.fixture
def idle_broker(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], list[tuple[str, list[Any]]]]]:
    """This process's Celery app sending to the real idle broker (db 14: no worker consumes it).

    Yields a function that reads the (task name, args) of the messages waiting there, oldest first:
    what a worker would receive."""
    import redis

    from service.config import get_settings
    from service.queue import get_celery

    monkeypatch.setenv("TUNEHOUSE_BROKER_URL", IDLE_BROKER)
    monkeypatch.setenv("TUNEHOUSE_JOB_QUEUE", IDLE_QUEUE)
    get_settings.cache_clear()
    get_celery.cache_clear()
    broker = redis.Redis.from_url(IDLE_BROKER)

    def waiting() -> list[tuple[str, list[Any]]]:
        out = []
        for raw in reversed(broker.lrange(IDLE_QUEUE, 0, -1)):  # kombu LPUSHes: the oldest is last
            message = json.loads(raw)
            args = json.loads(base64.b64decode(message["body"]))[0]
            out.append((message["headers"]["task"], args))
        return out

    yield waiting
    broker.close()
    get_settings.cache_clear()  # the next caller reads the environment as monkeypatch restores it
    get_celery.cache_clear()


@dataclass
class Stack:
    url: str
    worker: subprocess.Popen[bytes]
    inference: subprocess.Popen[bytes]


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """API server + one Celery training worker + one inference worker over Redis + PostgreSQL: jobs
    really train and /v1/chat/completions really generates."""
    url, server = start_server({"TUNEHOUSE_BROKER_URL": WORKER_BROKER})
    env = {**os.environ, "TUNEHOUSE_BROKER_URL": WORKER_BROKER}
    worker = subprocess.Popen(
        [sys.executable, "-m", "tunehouse.cli", "worker", "--loglevel", "warning"], env=env
    )
    inference = subprocess.Popen(
        [sys.executable, "-m", "tunehouse.cli", "worker", "--inference", "--loglevel", "warning"], env=env
    )
    yield Stack(url=url, worker=worker, inference=inference)
    _stop(inference)
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
