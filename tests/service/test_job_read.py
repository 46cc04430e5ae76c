"""A job's read, the call a polling dashboard makes most, on real PostgreSQL through psycopg's async
connections (service/dependencies.py `read_row`, service/db_reads.py): one statement gives the job and
its queue position, and it runs outside a transaction block (no BEGIN and COMMIT round trips around it).

The rows sit in a queue of their own, so no worker claims them and no other test's jobs share their
positions.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.pq import TransactionStatus
from sqlalchemy import select

from service.db import session_scope
from service.db_reads import CompiledRead, close_read_connections
from service.dependencies import read_row
from service.ids import new_id
from service.jobs import repository
from service.jobs.fairness import queue_positions
from service.models import Tenant
from tests.conftest import new_key
from tests.helpers import job_row, new_tenant

_JOB_READ = CompiledRead(repository.job_read_query())


def _read_each(
    tenant: Any, job_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, int | None], list[str], set[Any]]:
    """Each job's position as its read gives it, the statements those reads sent, and the connection's
    transaction status after each read's statement."""
    statements: list[str] = []
    statuses: set[Any] = set()
    execute = psycopg.AsyncConnection.execute

    async def recording(self: psycopg.AsyncConnection[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        cursor = await execute(self, query, *args, **kwargs)
        statements.append(str(query))
        statuses.add(self.info.transaction_status)
        return cursor

    monkeypatch.setattr(psycopg.AsyncConnection, "execute", recording)  # the real driver, watched

    async def main() -> dict[str, int | None]:
        try:
            positions: dict[str, int | None] = {}
            for job_id in job_ids:
                row = await read_row(_JOB_READ, {"job_id": job_id, "tenant_id": tenant.id})
                assert row is not None and row.id == job_id
                positions[job_id] = row.queue_position
            return positions
        finally:
            await close_read_connections()  # they belong to this test's event loop

    return asyncio.run(main()), statements, statuses


def test_a_jobs_read_gives_its_queue_position_in_one_statement_outside_a_transaction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tenant = new_tenant("job-read")
    queue = f"test-job-read-{new_id('q')}"
    now = time.time()
    with session_scope() as session:
        queued = [job_row(tenant.id, queue=queue, queued_at=now + i) for i in range(3)]
        done = job_row(tenant.id, "succeeded", queue=queue, queued_at=now - 1)
        session.add_all([*queued, done])
    job_ids = [j.id for j in [*queued, done]]

    positions, statements, statuses = _read_each(tenant, job_ids, monkeypatch)

    with session_scope() as session:
        expected = queue_positions(session, job_ids)
    assert positions == {queued[0].id: 1, queued[1].id: 2, queued[2].id: 3, done.id: None}
    assert {j: p for j, p in positions.items() if p is not None} == expected
    assert len(statements) == len(job_ids)  # one per read: the position comes with the job
    assert statuses == {TransactionStatus.IDLE}  # autocommit: no transaction left open to COMMIT


def test_a_jobs_read_gives_the_job_its_list_gives_in_every_state(api_url: str) -> None:
    """`GET /v1/fine_tuning/jobs/{id}` reads plain rows (`job_read_query`), the list reads `Job` objects:
    both make the same object, every field, for jobs in each state and with every optional column set."""
    name = f"job-read-{new_id('t')}"
    key = new_key(name)
    queue = f"test-job-read-{new_id('q')}"
    now = int(time.time())
    with session_scope() as session:
        tenant_id = session.scalar(select(Tenant.id).where(Tenant.name == name))
        assert tenant_id is not None
        rows = [
            job_row(tenant_id, queue=queue, queued_at=now, user_metadata={"team": "a"}, suffix="s"),
            job_row(tenant_id, queue=queue, queued_at=now + 1, validation_file="file-v"),
            job_row(
                tenant_id,
                "running",
                queue=queue,
                started_at=now,
                current_step=3,
                total_steps=10,
                trained_tokens=300,
                estimated_finish=now + 60,
                resources={"gpus": 2, "strategy": "ddp"},
                integrations=[{"type": "wandb", "wandb": {"project": "p"}}],
            ),
            job_row(
                tenant_id,
                "failed",
                queue=queue,
                finished_at=now,
                error={"code": "invalid_training_file", "message": "line 3", "param": "training_file"},
            ),
            job_row(
                tenant_id,
                "succeeded",
                queue=queue,
                finished_at=now,
                fine_tuned_model="ft:tiny:s",
                result_files=["file-r"],
                trained_tokens=1000,
            ),
        ]
        session.add_all(rows)
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {key}"}) as client:
        page = client.get("/v1/fine_tuning/jobs", params={"limit": 100}).json()
        listed = {j["id"]: j for j in page["data"]}
        read = {r.id: client.get(f"/v1/fine_tuning/jobs/{r.id}").json() for r in rows}
    assert set(listed) == set(read)
    assert read == listed
    first = read[rows[0].id]
    assert (first["queue_position"], first["metadata"], first["user_provided_suffix"]) == (
        1,
        {"team": "a"},
        "s",
    )
    running = read[rows[2].id]
    assert (running["estimated_finish"], running["resources"]["gpus"]) == (now + 60, 2)
    assert read[rows[3].id]["error"]["param"] == "training_file"
    assert read[rows[4].id]["result_files"] == ["file-r"]
