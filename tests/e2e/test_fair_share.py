"""Fair share through the whole stack (API server, real Celery worker, PostgreSQL, Redis): tenant A's
backlog does not starve tenant B's single job, and queued jobs show where they stand.

A's jobs are long (many epochs) and are cancelled by the test, so the test takes a few job starts,
not a few trainings: one worker (solo pool) runs one job at a time, so when A's running job ends the
next job to start is the fairest, B's, although A's backlog was queued before it.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.conftest import Stack, new_key
from tests.helpers import TERMINAL, chat_rows, upload_ok, wait_for

# far more steps than the test waits for; every weight trained, so that each job holds the worker alone
# (LoRA jobs on one base would join one trainer process: worker/shared_runs.py)
LONG = {"n_epochs": 100, "batch_size": 1, "lora": False}


def _submit(client: httpx.Client, train: str) -> dict[str, Any]:
    response = client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": "tunehouse/tiny-llama",
            "training_file": train,
            "method": {"type": "supervised", "supervised": {"hyperparameters": LONG}},
        },
    )
    assert response.status_code == 200, response.text
    job: dict[str, Any] = response.json()
    return job


def _get(client: httpx.Client, job_id: str) -> dict[str, Any]:
    job: dict[str, Any] = client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    return job


def _training(client: httpx.Client, job_id: str) -> None:
    """Wait for the job's first step: from then on its trainer sees a cancel within a control poll (a
    cancel during the trainer's start-up would cost the worker's lost-lease grace, 30 s)."""
    deadline = time.monotonic() + 120
    while _get(client, job_id)["current_step"] < 1:
        assert time.monotonic() < deadline, f"{job_id} made no step"
        time.sleep(0.3)


def test_second_tenant_starts_within_one_job_slot(stack: Stack) -> None:
    clients = [
        httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {new_key()}"}, timeout=60)
        for _ in range(2)
    ]
    a, b = clients
    a_jobs: list[str] = []
    b_job: dict[str, Any] = {}
    try:
        train_a, train_b = upload_ok(a, chat_rows(8)), upload_ok(b, chat_rows(8))
        a_jobs = [_submit(a, train_a)["id"] for _ in range(6)]
        first = wait_for(a, a_jobs[0], statuses=("running",), timeout=120)
        assert first["queue_position"] is None
        _training(a, a_jobs[0])
        # A's five others wait in first-in-first-out order among themselves
        positions = [_get(a, j)["queue_position"] for j in a_jobs[1:]]
        assert positions == sorted(positions) and None not in positions, positions

        submitted = time.monotonic()
        b_job = _submit(b, train_b)
        # B has nothing running and was never served: it is next although A queued five before it
        assert b_job["status"] == "queued" and b_job["queue_position"] == 1, b_job
        assert _get(a, a_jobs[1])["queue_position"] == 2

        assert a.post(f"/v1/fine_tuning/jobs/{a_jobs[0]}/cancel").status_code == 200  # the slot frees
        started = wait_for(b, b_job["id"], statuses=("running", *TERMINAL), timeout=120)
        waited = time.monotonic() - submitted
        assert started["status"] == "running", started
        assert started["queue_position"] is None
        # B took the one slot that freed: A's backlog is all still queued, untouched
        assert [_get(a, j)["status"] for j in a_jobs[1:]] == ["queued"] * 5
        assert [_get(a, j)["queue_position"] for j in a_jobs[1:]] == [1, 2, 3, 4, 5]
        print(f"\nB's job started {waited:.1f}s after it was submitted (one job slot: A's job cancelled)")

        _training(b, b_job["id"])
    finally:
        # the queued ones first, newest first, so the worker starts none of them meanwhile
        for job_id in reversed(a_jobs):
            a.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
        if b_job:
            b.post(f"/v1/fine_tuning/jobs/{b_job['id']}/cancel")
        for job_id in a_jobs:
            wait_for(a, job_id, timeout=120)
        for client in clients:
            client.close()
