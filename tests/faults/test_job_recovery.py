"""No job lost or run twice: broker down at creation, a trainer killed by SIGKILL, restarts running out,
pause/resume, a worker stopped with SIGTERM. Real uvicorn, Celery workers, PostgreSQL and Redis, the
latter two private to this module (tests/faults/servers.py): the broker is stopped and started again.

Settings that differ from the defaults, to keep the module fast: checkpoints every 0.02 min (1.2 s)
instead of 10 min (TUNEHOUSE_CHECKPOINT_MINUTES: the jobs themselves set no save_steps/save_minutes,
so the time-based default is what saves them), 1 restart instead of 3 (TUNEHOUSE_MAX_RESTARTS), and
the harness' reconciler pass every second with a 5 s dispatch timeout. One stack serves the whole
module: starting PostgreSQL, the API and a worker costs more than the tests themselves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.faults.servers import FaultStack, postgres_server, redis_server
from tests.helpers import all_pages, chat_rows, trainer_pid, until, upload_ok, wait_for

MODEL = "tunehouse/tiny-llama"
SETTINGS = {"TUNEHOUSE_CHECKPOINT_MINUTES": "0.02", "TUNEHOUSE_MAX_RESTARTS": "1"}


@dataclass
class Env:
    stack: FaultStack
    client: httpx.Client

    @property
    def workers(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.stack.procs if "worker" in p.args]


@pytest.fixture(scope="module")
def recovery() -> Iterator[Env]:
    with postgres_server() as pg, redis_server() as rds:
        stack = FaultStack(pg=pg, redis=rds, data_dir=Path(tempfile.mkdtemp(prefix="tunehouse-recovery-")))
        stack.extra_env.update(SETTINGS)
        try:
            url, _ = stack.start_api()
            stack.start_worker()
            headers = {"Authorization": f"Bearer {stack.new_key()}"}
            with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
                yield Env(stack=stack, client=client)
        finally:
            stack.close()


def _spec(training_file: str, seed: int) -> dict[str, Any]:
    # 50 epochs x 32 steps (ROWS rows, 2 a step): longer than any test waits, even at the ~120 steps/s
    # of a quiet machine; the tests cancel their jobs once they have seen what they need, so they do not
    # depend on how fast this machine trains
    hp = {"n_epochs": 50, "batch_size": 2, "learning_rate": 1e-3}
    return {
        "model": MODEL,
        "training_file": training_file,
        "seed": seed,
        "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
    }


def _create(client: httpx.Client, seed: int = 5) -> str:
    response = client.post("/v1/fine_tuning/jobs", json=_spec(upload_ok(client, chat_rows(ROWS)), seed))
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def _events(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    return all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/events")[::-1]  # oldest first


def _kinds(events: list[dict[str, Any]]) -> list[str]:
    # the job's transitions (checkpoint events carry a kind too: checkpoint.created)
    return [k for e in events if e["data"] and (k := e["data"].get("kind", "")).startswith("job.")]


def _checkpoint_steps(client: httpx.Client, job_id: str) -> list[int]:
    data = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    return sorted(c["step_number"] for c in data if not c["is_final"])


def _assert_complete_record(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    """Every step's metric row exactly once, from 1 on, and no "Step N" event written twice."""
    metrics = all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/metrics")
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    step_events = [e["data"]["step"] for e in _events(client, job_id) if e["type"] == "metrics"]
    assert len(step_events) == len(set(step_events)), "a Step N event was written twice"
    assert set(step_events) == set(range(1, len(metrics) + 1))
    return metrics


def _step(client: httpx.Client, job_id: str) -> int:
    return int(client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["current_step"])


def _cancel_after(client: httpx.Client, job_id: str, step: int) -> None:
    """Let a long job train past `step`, then cancel it: the tests need its first steps only."""
    until(lambda: _step(client, job_id) > step, f"step {step}")
    assert client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    until(lambda: trainer_pid(job_id) is None, "the trainer to stop", timeout=60)


def _resumed_at(events: list[dict[str, Any]]) -> list[int]:
    prefix = "Resuming from the checkpoint at step "
    return [int(e["message"].removeprefix(prefix)) for e in events if e["message"].startswith(prefix)]


@dataclass(frozen=True)
class CreatedWhileDown:
    job_id: str
    status: int
    seconds: float
    status_during_outage: str


ROWS = 64  # the training file of every job here

# how far the job created during the outage trains (uninterrupted): the pause test's reference, so far
# past where that test's job pauses (a fast host trained it to step 67 between asking for the pause and
# its checkpoint, past the 60 this once was)
REFERENCE_STEPS = 200


@pytest.fixture(scope="module")
def created_while_broker_down(recovery: Env) -> CreatedWhileDown:
    """A job created while Redis (the broker) is down, then Redis back; it trains REFERENCE_STEPS
    steps uninterrupted and is cancelled. Same spec and seed as the pause test's job."""
    client = recovery.client
    train = upload_ok(client, chat_rows(ROWS))
    recovery.stack.redis.stop()
    try:
        started = time.monotonic()
        response = client.post("/v1/fine_tuning/jobs", json=_spec(train, seed=11))
        seconds = time.monotonic() - started
        job_id = str(response.json()["id"])
        time.sleep(1.5)  # a reconciler pass or two fail meanwhile
        during = str(client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"])
    finally:
        recovery.stack.redis.start()
    _cancel_after(client, job_id, REFERENCE_STEPS)
    return CreatedWhileDown(job_id, response.status_code, seconds, during)


def test_broker_down_at_create_then_job_runs_once(
    recovery: Env, created_while_broker_down: CreatedWhileDown
) -> None:
    job = created_while_broker_down
    assert job.status == 200  # stored and answered: the reconciler sends it once the broker is back
    assert job.seconds < 5, f"creating a job with the broker down took {job.seconds:.1f}s"
    assert job.status_during_outage == "queued"
    events = _events(recovery.client, job.job_id)
    assert _kinds(events) == ["job.queued", "job.running", "job.cancelled"]  # it ran once
    assert _resumed_at(events) == []
    _assert_complete_record(recovery.client, job.job_id)
    print(f"\nbroker down: POST /v1/fine_tuning/jobs answered {job.status} in {job.seconds:.2f}s; ran once")


def test_killed_trainer_resumes_from_time_checkpoint_until_restarts_run_out(recovery: Env) -> None:
    client = recovery.client
    job_id = _create(client)  # no save_steps: only the time-based default saves it
    until(lambda: _checkpoint_steps(client, job_id), "a time-based checkpoint")
    first = until(lambda: trainer_pid(job_id), "the trainer")
    os.kill(first, signal.SIGKILL)
    until(lambda: _resumed_at(_events(client, job_id)), "the restarted run to resume")
    resumed_at = _resumed_at(_events(client, job_id))[0]
    assert resumed_at > 0  # from the time-based checkpoint, not from step 0
    until(lambda: _step(client, job_id) > resumed_at + 1, "progress after the restart")

    # TUNEHOUSE_MAX_RESTARTS=1: the second death of the same job fails it, the system's fault
    second = until(lambda: (pid := trainer_pid(job_id)) != first and pid, "the restarted trainer")
    os.kill(second, signal.SIGKILL)
    job = wait_for(client, job_id, timeout=120)
    assert job["status"] == "failed"
    assert job["error"]["fault"] == "system" and job["error"]["code"] == "internal_error"
    message = job["error"]["message"]
    assert "killed by SIGKILL" in message and "gave up after 1 restart" in message
    events = _events(client, job_id)
    assert _kinds(events) == ["job.queued", "job.running", "job.restarted", "job.running", "job.failed"]
    restarted = next(e for e in events if e["data"] and e["data"].get("kind") == "job.restarted")
    assert "killed by SIGKILL" in restarted["data"]["cause"] and restarted["level"] == "warn"
    assert restarted["data"]["restart"] == 1 and restarted["data"]["max_restarts"] == 1
    _assert_complete_record(client, job_id)  # the steps re-run after the restart are not repeated


def test_pause_then_resume_repeats_the_uninterrupted_losses(
    recovery: Env, created_while_broker_down: CreatedWhileDown
) -> None:
    """Paused after a few steps, resumed, cancelled a few steps later: the same losses as the job of
    the same spec and seed that trained uninterrupted (the one created while the broker was down)."""
    client = recovery.client
    job_id = _create(client, seed=11)
    url = f"/v1/fine_tuning/jobs/{job_id}"
    until(lambda: _step(client, job_id) >= 2, "training")
    asked = client.post(f"{url}/pause")
    assert asked.status_code == 200, asked.text
    assert asked.json()["status"] == "running"  # it checkpoints at its next step, then it is paused
    paused = wait_for(client, job_id, ("paused", "succeeded", "failed"), timeout=60)
    assert paused["status"] == "paused", paused
    until(lambda: trainer_pid(job_id) is None, "the trainer to exit", timeout=30)
    at = paused["current_step"]
    assert _checkpoint_steps(client, job_id)[-1] == at
    conflict = client.post(f"{url}/pause")
    assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "job_not_pausable"
    time.sleep(1)
    assert _step(client, job_id) == at  # nothing trains while paused

    assert client.post(f"{url}/resume").json()["status"] == "queued"
    _cancel_after(client, job_id, at + 3)
    assert _resumed_at(_events(client, job_id)) == [at]
    kinds = _kinds(_events(client, job_id))
    assert kinds == [
        "job.queued",
        "job.running",
        "job.pause_requested",
        "job.paused",
        "job.resumed",
        "job.running",
        "job.cancelled",
    ]
    resumed = _assert_complete_record(client, job_id)

    reference = all_pages(client, f"/v1/fine_tuning/jobs/{created_while_broker_down.job_id}/metrics")
    # both were cancelled, each a few steps past its mark (more on a loaded machine): compare the steps
    # both have, which must reach past the resume point
    common = min(len(reference), len(resumed))
    assert common > at + 2, (len(reference), len(resumed), at)
    assert [m["loss"] for m in resumed][:common] == pytest.approx(
        [m["loss"] for m in reference][:common], abs=1e-6
    )


def test_sigterm_to_a_worker_hands_its_job_to_another(recovery: Env) -> None:
    client = recovery.client
    recovery.stack.start_worker()
    job_id = _create(client)
    until(lambda: _step(client, job_id) >= 2, "training")
    holder = next(
        e["data"]["worker"]
        for e in reversed(_events(client, job_id))
        if e["data"] and e["data"].get("kind") == "job.running"
    )
    worker = next(w for w in recovery.workers if w.pid == int(holder.rsplit(":", 1)[1]))
    stopped_at = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    worker.wait(timeout=90)
    took = time.monotonic() - stopped_at
    assert took < 30, f"the worker took {took:.1f}s to hand its job back and exit"
    print(f"\nSIGTERM: the worker handed its job back and exited in {took:.1f}s")

    until(lambda: _resumed_at(_events(client, job_id)), "another worker to resume it")
    handed_at = _resumed_at(_events(client, job_id))[0]
    _cancel_after(client, job_id, handed_at + 2)
    events = _events(client, job_id)
    kinds = _kinds(events)
    assert kinds[:4] == ["job.queued", "job.running", "job.handed_back", "job.running"]
    assert "job.restarted" not in kinds  # not charged as a crash
    handed = next(e for e in events if e["data"] and e["data"].get("kind") == "job.handed_back")
    assert f"checkpoint saved at step {handed_at}" in handed["message"]
    workers = [e["data"]["worker"] for e in events if e["data"] and e["data"].get("kind") == "job.running"]
    assert workers[0] == holder and workers[1] != holder
    _assert_complete_record(client, job_id)
