"""Small helpers shared by the service and end-to-end tests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
from sqlalchemy.orm import sessionmaker

from service.ids import new_id
from service.models import Job, Tenant

TERMINAL = ("succeeded", "failed", "cancelled")


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def chat_rows(n: int = 16) -> list[dict[str, Any]]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
            ]
        }
        for i in range(n)
    ]


def upload(
    client: httpx.Client, data: bytes, name: str = "train.jsonl", purpose: str = "fine-tune"
) -> httpx.Response:
    return client.post("/v1/files", files={"file": (name, data)}, data={"purpose": purpose})


def upload_ok(client: httpx.Client, rows: list[dict[str, Any]]) -> str:
    response = upload(client, jsonl(rows))
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def wait_for(
    client: httpx.Client, job_id: str, statuses: tuple[str, ...] = TERMINAL, timeout: float = 240
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
        if job["status"] in statuses:
            return job
        time.sleep(0.3)
    raise TimeoutError(f"job {job_id} did not reach {statuses}; last: {job}")


def all_pages(client: httpx.Client, path: str, **params: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    after = None
    while True:
        query = dict(params, **({"after": after} if after is not None else {}))
        body = client.get(path, params=query).json()
        out += body["data"]
        if not body["has_more"]:
            return out
        after = body["data"][-1]["id"] if "id" in body["data"][-1] else body["data"][-1]["step"]


def tenant_of(key: str) -> str:
    from service.auth import authenticate
    from service.db import session_scope

    with session_scope() as session:
        return authenticate(session, key).id


def stored_counts(tenant_id: str) -> dict[str, int]:
    """What a tenant has stored (rows, and blob files, temp files of aborted uploads included): what a
    rejected request must leave unchanged. Scoped to the tenant, so a job of another test that is still
    running cannot disturb the count."""
    from sqlalchemy import func, select

    from service.config import get_settings
    from service.db import session_scope
    from service.models import (
        ApiKey,
        File,
        Job,
        JobEvent,
        JobMetric,
        Tenant,
        WebhookDelivery,
        WebhookEndpoint,
    )

    with session_scope() as session:

        def count(model: Any, *where: Any) -> int:
            return int(session.scalar(select(func.count()).select_from(model).where(*where)) or 0)

        jobs = select(Job.id).where(Job.tenant_id == tenant_id)
        counts = {
            "tenants": count(Tenant),
            "api_keys": count(ApiKey),
            "files": count(File, File.tenant_id == tenant_id),
            "jobs": count(Job, Job.tenant_id == tenant_id),
            "job_events": count(JobEvent, JobEvent.job_id.in_(jobs)),
            "job_metrics": count(JobMetric, JobMetric.job_id.in_(jobs)),
            "webhook_endpoints": count(WebhookEndpoint, WebhookEndpoint.tenant_id == tenant_id),
            "webhook_deliveries": count(
                WebhookDelivery,
                WebhookDelivery.endpoint_id.in_(
                    select(WebhookEndpoint.id).where(WebhookEndpoint.tenant_id == tenant_id)
                ),
            ),
        }
    root = get_settings().data_dir / "blobs" / "files" / tenant_id
    counts["blobs"] = sum(1 for p in root.rglob("*") if p.is_file()) if root.exists() else 0
    return counts


T = TypeVar("T")


def until(check: Callable[[], T], what: str, timeout: float = 180) -> T:
    """``check()``'s first truthy result, asked every 0.1 s; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return result


def spare_trainers(worker: int) -> list[int]:
    """The worker process's idle spare trainers (worker/spare_trainer.py): its children whose command line
    is still the spare's (one given a job renames itself after it)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if ppid == worker and b"--spare" in argv:
            found.append(int(stat.parent.name))
    return found


def trainer_pid(job_id: str, *, rank: int | None = None) -> int | None:
    """The per-job trainer process (`python -m worker.job_process JOB_ID ...`) of this job, if alive; of a
    multi-GPU job, the process of `rank` (RANK in its environment; its launcher has the same argv). A job
    on a shared base: the process that trains it with the others (its command line names them all)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # a spare trainer given the job rewrote its command line as one string (setproctitle)
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").split()
            environ = (entry / "environ").read_bytes().split(b"\0") if rank is not None else []
        except OSError:
            continue
        ours = b"worker.job_process" in argv and job_id.encode() in argv
        if ours and (rank is None or f"RANK={rank}".encode() in environ):
            return int(entry.name)
    return None


@contextmanager
def own_database(suffix: str) -> Iterator[sessionmaker[Any]]:
    """A fresh, migrated PostgreSQL database `<test database>_<suffix>` for one test module, dropped
    after. For rows the e2e stack's long-lived worker must not see: its reconciler and claims would race
    the module's own queued or stale rows in the shared database."""
    from sqlalchemy import create_engine, text

    from service.db import make_engine
    from service.migrate import upgrade_head
    from tests.conftest import PG_DATABASE, PG_SERVER

    name = f"{PG_DATABASE}_{suffix}"
    admin = create_engine(f"{PG_SERVER}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = f"{PG_SERVER}/{name}"
    upgrade_head(url)
    engine = make_engine(url)
    try:
        yield sessionmaker(bind=engine, expire_on_commit=False)
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def job_row(tenant_id: str, status: str = "queued", **values: Any) -> Job:
    """A job row as the API stores one (supervised, on the tiny model), for tests that write rows
    directly; `values` sets or overrides any column."""
    fields: dict[str, Any] = {
        "id": new_id("ftjob"),
        "model": "tunehouse/tiny-llama",
        "training_file": "file-x",
        "method": {"type": "supervised", "supervised": {"hyperparameters": {}}},
        "seed": 0,
    }
    return Job(tenant_id=tenant_id, status=status, **(fields | values))


def new_tenant(prefix: str) -> Tenant:
    """A tenant row, committed, named ``prefix-<id>``."""
    from service.db import session_scope

    with session_scope() as session:
        row = Tenant(id=new_id("tenant"), name=f"{prefix}-{new_id('t')}")
        session.add(row)
    return row


def start_tinker_host(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A Tinker host process (worker/tinker_host.py), once it has announced itself in Redis."""
    import redis

    from service.tinker.channel import key

    proc = subprocess.Popen([sys.executable, "-m", "worker.tinker_host"], env=env)
    client = redis.Redis.from_url(env["TUNEHOUSE_REDIS_URL"])
    deadline = time.monotonic() + 120
    while not list(client.scan_iter(key("host", f"tinkerhost-{proc.pid}-*"))):
        assert proc.poll() is None and time.monotonic() < deadline, "the Tinker host did not start"
        time.sleep(0.1)
    client.close()
    return proc
