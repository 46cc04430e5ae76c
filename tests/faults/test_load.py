"""Many tiny jobs from 4 tenants on 2 workers: every job runs exactly once and none is left behind.

Each job is real (a fresh trainer process that imports torch/transformers/peft, loads the tiny model
and trains one step): measured ~10 s of CPU per job, almost all of it the imports, so 200 jobs need
~2000 CPU-seconds, over 15 minutes on 2 cores. CI runs 12 (the `ci` case); the 200-job case is
`slow`: `pytest tests/faults -m slow -k load`.
"""

from __future__ import annotations

import time
from collections import Counter

import httpx
import pytest

from tests.faults.jobs import create_job
from tests.faults.servers import FaultStack
from tests.helpers import TERMINAL, all_pages, chat_rows, upload_ok

TENANTS = 4
WORKERS = 2
# only a bound to call a job stuck: a job costs ~10 s of CPU when idle, ~40 s wall on a shared 2-core box
SECONDS_PER_JOB = 60.0


@pytest.mark.parametrize(
    "n_jobs", [pytest.param(12, id="ci"), pytest.param(200, id="full", marks=pytest.mark.slow)]
)
def test_many_tiny_jobs_run_exactly_once(fault_stack: FaultStack, n_jobs: int) -> None:
    url, _ = fault_stack.start_api()
    for _ in range(WORKERS):
        fault_stack.start_worker()
    clients = [
        httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {fault_stack.new_key(f't{i}')}"}, timeout=60
        )
        for i in range(TENANTS)
    ]
    files = [upload_ok(c, chat_rows(4)) for c in clients]
    started = time.monotonic()
    jobs: list[tuple[httpx.Client, str]] = []
    for n in range(n_jobs):
        client = clients[n % TENANTS]
        jobs.append((client, create_job(client, files[n % TENANTS], max_steps=1, batch_size=4)))
    submitted = time.monotonic() - started

    deadline = started + SECONDS_PER_JOB * n_jobs / WORKERS + 60
    pending = dict(jobs_by_id := {job_id: client for client, job_id in jobs})
    final: dict[str, str] = {}
    while pending and time.monotonic() < deadline:
        for job_id, client in list(pending.items()):
            status = client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"]
            if status in TERMINAL:
                final[job_id] = status
                del pending[job_id]
        time.sleep(1.0)
    wall = time.monotonic() - started

    starts = {
        job_id: sum(
            e["message"].startswith("Job started on worker")
            for e in all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/events")
        )
        for job_id, client in jobs_by_id.items()
    }
    steps = {
        job_id: [m["step"] for m in all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/metrics")]
        for job_id, client in jobs_by_id.items()
    }
    # another tenant's job is a 404: the load did not mix tenants up
    other_client, other_job = clients[1], jobs[0][1]
    assert other_client.get(f"/v1/fine_tuning/jobs/{other_job}").status_code == 404
    outcome = Counter(final.values())
    duplicated = sorted(j for j, n in starts.items() if n > 1)
    print(
        f"\nload: {n_jobs} jobs from {TENANTS} tenants on {WORKERS} workers, submitted in {submitted:.1f}s; "
        f"succeeded {outcome['succeeded']}, failed {outcome['failed']}, duplicated {len(duplicated)}, "
        f"lost/stuck {len(pending)}; wall {wall:.1f}s ({wall / n_jobs:.1f}s per job)"
    )
    assert not pending, f"stuck: {sorted(pending)}"
    assert outcome == Counter({"succeeded": n_jobs}), outcome
    assert not duplicated, duplicated
    assert all(s == [1] for s in steps.values()), steps
    for client in clients:
        client.close()
