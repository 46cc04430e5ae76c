"""Servers a fault test may break: its OWN PostgreSQL cluster and redis-server, plus the API and workers.

The suite's shared PostgreSQL (5432) and Redis are never stopped: a test that takes a database or a
broker away starts private ones here (temp data dir, free port, trust auth), stops and restarts them
on the same port and data dir, and removes them by pid at the end. `FaultStack` wires uvicorn and
Celery workers to them through the same `TUNEHOUSE_*` variables production uses.

    with postgres_server() as pg, redis_server() as rds:
        stack = FaultStack(pg=pg, redis=rds, data_dir=tmp_path)
        api = stack.start_api()
        worker = stack.start_worker()
        pg.stop(); ...; pg.start()
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import free_port, start_server


def _pg_bin() -> Path:
    """Where initdb/pg_ctl live: $TUNEHOUSE_TEST_PG_BIN, /usr/local/bin, or Debian's newest version."""
    if "TUNEHOUSE_TEST_PG_BIN" in os.environ:
        return Path(os.environ["TUNEHOUSE_TEST_PG_BIN"])
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name))
    candidates = [Path("/usr/local/bin"), *reversed(debian)]
    return next((c for c in candidates if (c / "initdb").exists()), candidates[0])


PG_BIN = _pg_bin()
DATABASE = "tunehouse"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


class PostgresServer:
    """A throwaway PostgreSQL cluster. `stop()`/`start()` keep its port and data, like a DB restart.

    `initdb` costs seconds on a loaded machine, so the first cluster of a session (initdb + the
    `tunehouse` database migrated to head) becomes a template that later ones copy.
    """

    def __init__(self, root: Path, *, template: Path | None = None) -> None:
        self.root = root
        self.data = root / "data"
        self.port = free_port()
        self.log = root / "postgres.log"
        self.pid: int | None = None
        # initdb and postgres refuse to run as root; CI containers often are root
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            shutil.chown(root, "postgres", "postgres")
        if template is None:
            self._run([str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-N"])
        else:  # cp -a keeps the owner and the 0700 mode postgres insists on
            self._run(["cp", "-a", str(template), str(self.data)])

    @property
    def server_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.server_url}/{DATABASE}"

    def _run(self, cmd: list[str]) -> None:
        out = subprocess.run([*self._as, *cmd], capture_output=True, text=True, timeout=120, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stdout}{out.stderr}")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options, "-w",
                   "-t", "60", "start"])  # fmt: skip
        self.pid = int((self.data / "postmaster.pid").read_text().split()[0])

    def stop(self) -> None:
        """Fast shutdown: open connections are cut, like an operator's `pg_ctl stop -m fast`."""
        if self.pid is None:
            return
        os.kill(self.pid, signal.SIGINT)
        if not _wait_gone(self.pid, 60):
            os.kill(self.pid, signal.SIGKILL)
            _wait_gone(self.pid, 10)
        self.pid = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


_template: Path | None = None


def _pg_template() -> Path:
    """A stopped cluster's data dir holding the migrated `tunehouse` database; made once per session."""
    global _template
    if _template is None:
        from sqlalchemy import create_engine, text

        from service.migrate import upgrade_head

        server = PostgresServer(Path(tempfile.mkdtemp(prefix="tunehouse-pg-template-")))
        atexit.register(shutil.rmtree, server.root, True)
        server.start()
        try:
            engine = create_engine(f"{server.server_url}/postgres", isolation_level="AUTOCOMMIT")
            with engine.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{DATABASE}"'))
            engine.dispose()
            upgrade_head(server.url)
        finally:
            server.stop()
        _template = server.data
    return _template


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A started cluster of its own, with the `tunehouse` database at the newest migration."""
    server = PostgresServer(Path(tempfile.mkdtemp(prefix="tunehouse-pg-")), template=_pg_template())
    try:
        server.start()
        yield server
    finally:
        server.close()


class RedisServer:
    """A private redis-server without persistence: a restart loses every queued message, as in prod
    without AOF. `stop()`/`start()` keep the port."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        import redis

        log = (self.root / "redis.log").open("ab")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.root)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, f"redis-server exited: {(self.root / 'redis.log').read_text()}"
            try:
                if redis.Redis.from_url(self.url, socket_timeout=1).ping():
                    return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def freeze(self) -> None:
        """SIGSTOP: the server keeps its sockets open and answers nothing (a hung host, not a down one)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None:
            self.thaw()  # a stopped process does not act on SIGTERM until it runs again
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(Path(tempfile.mkdtemp(prefix="tunehouse-redis-")))
    try:
        server.start()
        yield server
    finally:
        server.close()


@dataclass
class FaultStack:
    """API servers and Celery workers on a private PostgreSQL + Redis; everything started is stopped
    by `close()` (the fixture calls it)."""

    pg: PostgresServer
    redis: RedisServer
    data_dir: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self, **overrides: str) -> dict[str, str]:
        return {
            "TUNEHOUSE_DATABASE_URL": self.pg.url,
            "TUNEHOUSE_BROKER_URL": f"{self.redis.url}/0",
            "TUNEHOUSE_REDIS_URL": f"{self.redis.url}/1",
            "TUNEHOUSE_DATA_DIR": str(self.data_dir),
            # recovery within seconds, not minutes: re-send unclaimed queued jobs after 5 s
            "TUNEHOUSE_DISPATCH_TIMEOUT_SECONDS": "5",
            "TUNEHOUSE_RECONCILE_SECONDS": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            **self.extra_env,
            **overrides,
        }

    def start_api(self, port: int | None = None, **overrides: str) -> tuple[str, subprocess.Popen[bytes]]:
        """uvicorn on `port` (a free one by default; pass the old one to restart "the same" server)."""
        url, proc = start_server(self.env(**overrides), port=port)
        self.procs.append(proc)
        return url, proc

    def start_worker(self, **overrides: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tunehouse.cli", "worker", "--loglevel", "warning"],
            env={**os.environ, **self.env(**overrides)},
            start_new_session=True,  # its own process group: stopping it takes its trainer along
        )
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM the process group (a worker and its trainer), SIGKILL after 30 s."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):  # not a group leader: an API server
                proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
                proc.wait()

    def new_key(self, tenant: str | None = None) -> str:
        """An API key in this stack's own database."""
        from sqlalchemy.orm import Session

        from service.auth import create_api_key
        from service.db import make_engine

        engine = make_engine(self.pg.url)
        try:
            with Session(engine) as session:
                _, key = create_api_key(session, tenant_name=tenant or f"tenant-{os.urandom(6).hex()}")
                session.commit()
        finally:
            engine.dispose()
        return key

    def close(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)
