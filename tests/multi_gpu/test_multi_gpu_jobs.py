"""Multi-GPU jobs through the whole stack, on CPU: a worker told it has 2 GPUs (`TUNEHOUSE_WORKER_GPUS`)
runs a `resources.gpus: 2` job as 2 gloo ranks launched by torch.distributed.run (worker/launch.py).

- A 2-rank SFT job (DDP or FSDP) and a 2-rank DPO job give the loss curve of a 1-rank job with the same
  global batch (`batch_size x gradient_accumulation_steps x gpus`), as the API reports it, and one set of
  checkpoints.
  Tolerance 1e-5 relative: the 2-rank step sums the same per-token losses and gradients in another order
  (each rank its micro-batches, then gloo the two partial sums), float32 rounding apart (measured ~1e-7);
  a wrong share of the batch or a wrong denominator moves the loss by more than 1e-2.
- Killing one rank mid-job ends the run (no rank left hanging), the job is requeued as a charged restart
  and resumes from its latest checkpoint on a fresh pair of ranks.
- Pause, resume and cancel reach both ranks: they stop at the same step, a paused job resumes on a fresh
  pair of ranks from its checkpoint, and no rank outlives a cancelled job.
- A 2-rank GRPO job (DDP or FSDP) covers the prompts of the 1-rank job with the same global batch, step
  by step.
- A job that asks for more GPUs than any live worker has stays queued, with the reason in its events.

The worker's "GPUs" are CPU processes here (no GPU in CI); on a GPU host the same path runs NCCL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import _stop, new_key, redis_db, start_server
from tests.e2e.test_preference_methods import preference_rows
from tests.helpers import all_pages, chat_rows, trainer_pid, upload_ok, wait_for

BROKER = redis_db(4)
QUEUE = "tunehouse-ranks"
ENV = {"TUNEHOUSE_BROKER_URL": BROKER, "TUNEHOUSE_JOB_QUEUE": QUEUE}
REL = 1e-5
CURVE = ("loss", "grad_norm", "learning_rate", "trained_tokens")


@pytest.fixture(scope="module")
def two_gpu_stack() -> Iterator[httpx.Client]:
    """An API server and one training worker with 2 "GPUs", on a broker and queue of their own."""
    import redis

    redis.Redis.from_url(BROKER).flushdb()
    url, server = start_server(ENV)
    worker = subprocess.Popen(
        [sys.executable, "-m", "tunehouse.cli", "worker", "--loglevel", "warning"],
        env={**os.environ, **ENV, "TUNEHOUSE_WORKER_GPUS": "2"},
    )
    headers = {"Authorization": f"Bearer {new_key()}"}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
            yield client
    finally:
        _stop(worker)
        _stop(server)


def _create(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/v1/fine_tuning/jobs", json={"model": "tunehouse/tiny-llama", "seed": 7, **body})
    assert response.status_code == 200, response.text
    job: dict[str, Any] = response.json()
    return job


def _method(kind: str, **hp: Any) -> dict[str, Any]:
    return {"type": kind, kind: {"hyperparameters": hp}}


def _steps(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    return all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/metrics")


def _checkpoint_steps(client: httpx.Client, job_id: str) -> list[int]:
    rows = all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/checkpoints")
    return sorted(int(c["step_number"]) for c in rows)


def _assert_same_curve(
    two: list[dict[str, Any]], one: list[dict[str, Any]], keys: tuple[str, ...], rel: float = REL
) -> None:
    assert [r["step"] for r in two] == [r["step"] for r in one]
    for a, b in zip(two, one, strict=True):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-7), (a["step"], key, a[key], b[key])


def _run_pair(
    client: httpx.Client, kind: str, rows: list[dict[str, Any]], hp: dict[str, Any], strategy: str = "ddp"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same training as 2 ranks x 2 micro-batches and as 1 rank x 4: (2-rank job, 1-rank job)."""
    train = upload_ok(client, rows)
    two = _create(
        client,
        {
            "training_file": train,
            "method": _method(kind, **hp, gradient_accumulation_steps=1),
            "resources": {"gpus": 2, "strategy": strategy},
        },
    )
    one = _create(
        client, {"training_file": train, "method": _method(kind, **hp, gradient_accumulation_steps=2)}
    )
    # the spec says what a step is: the same global batch, over 2 ranks or 1
    batch = 2 * hp["batch_size"]
    assert two["resources"] == {
        "nodes": 1,
        "gpus_per_node": 2,
        "gpus": 2,
        "strategy": strategy,
        "global_batch_size": batch,
    }
    assert one["resources"] == {
        "nodes": 1,
        "gpus_per_node": 1,
        "gpus": 1,
        "strategy": "ddp",
        "global_batch_size": batch,
    }
    done_two, done_one = wait_for(client, two["id"]), wait_for(client, one["id"])
    assert done_two["status"] == "succeeded", done_two
    assert done_one["status"] == "succeeded", done_one
    events = [e["message"] for e in all_pages(client, f"/v1/fine_tuning/jobs/{two['id']}/events")]
    assert any(m.startswith("Job started on worker") and ", 2 ranks" in m for m in events), events
    return done_two, done_one


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_rank_sft_job_matches_one_rank_job(two_gpu_stack: httpx.Client, strategy: str) -> None:
    """DDP, and FSDP (weights sharded over the 2 ranks; 1e-4: it computes the logits whole where one
    rank chunks the LM head, see tests/trainers/core/test_distributed.py)."""
    client = two_gpu_stack
    # 18 rows of 2 = 9 micro-batches an epoch, 2 a step: each epoch ends with a step of one micro-batch,
    # which rank 1 has no share of and must still take part in
    hp = {
        "n_epochs": 2,
        "batch_size": 2,
        "lora": False,
        "learning_rate": 1e-3,
        "warmup_ratio": 0.2,
        "lr_scheduler": "cosine",
        "weight_decay": 0.01,
        "save_steps": 2,
    }
    two, one = _run_pair(client, "supervised", chat_rows(18), hp, strategy)
    curve_two, curve_one = _steps(client, two["id"]), _steps(client, one["id"])
    assert len(curve_two) == 10  # 5 steps an epoch, the 5th of one micro-batch
    _assert_same_curve(curve_two, curve_one, CURVE, REL if strategy == "ddp" else 1e-4)
    # rank 0 alone checkpoints: one set, at the same steps as the 1-rank job's
    assert _checkpoint_steps(client, two["id"]) == _checkpoint_steps(client, one["id"])
    assert two["trained_tokens"] == one["trained_tokens"] > 0


def test_two_rank_dpo_job_matches_one_rank_job(two_gpu_stack: httpx.Client) -> None:
    client = two_gpu_stack
    hp = {"n_epochs": 1, "batch_size": 2, "learning_rate": 5e-3, "beta": 0.1}
    two, one = _run_pair(client, "dpo", preference_rows(10), hp)
    curve_two, curve_one = _steps(client, two["id"]), _steps(client, one["id"])
    assert len(curve_two) == 3  # 5 micro-batches of 2, 2 a step: the last step has one, on rank 0
    dpo = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
    _assert_same_curve(curve_two, curve_one, (*CURVE[:3], *dpo))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_rank_grpo_job_covers_the_one_rank_steps(two_gpu_stack: httpx.Client, strategy: str) -> None:
    """An online method on 2 ranks: each samples and trains its share of a step's prompts. Sampling
    differs from 1 rank's, so the curves are not compared (tests/trainers/core/test_distributed.py trains the
    online methods on 2 ranks with a signal); the grader here scores the prompt alone, so its step mean
    shows that a step covers the same prompts, over both ranks' completions."""
    client = two_gpu_stack
    prompts = [{"prompt": f"Question {i}:", "value": "yes" if i % 3 else "no"} for i in range(8)]
    train = upload_ok(client, prompts)
    grader = {
        "type": "string_check",
        "name": "v",
        "operation": "eq",
        "input": "{{item.value}}",
        "reference": "yes",
    }
    hp = {"n_epochs": 1, "batch_size": 2, "num_generations": 2, "max_completion_length": 4}

    def grpo(accumulation: int) -> dict[str, Any]:
        hyperparameters = {**hp, "gradient_accumulation_steps": accumulation}
        return {"type": "grpo", "grpo": {"grader": grader, "hyperparameters": hyperparameters}}

    resources = {"gpus": 2, "strategy": strategy}
    two = _create(client, {"training_file": train, "method": grpo(1), "resources": resources})
    one = _create(client, {"training_file": train, "method": grpo(2)})
    done_two, done_one = wait_for(client, two["id"]), wait_for(client, one["id"])
    assert done_two["status"] == "succeeded", done_two
    assert done_one["status"] == "succeeded", done_one
    events = [e["message"] for e in all_pages(client, f"/v1/fine_tuning/jobs/{two['id']}/events")]
    assert any(m.startswith("Job started on worker") and ", 2 ranks" in m for m in events), events
    curve_two, curve_one = _steps(client, two["id"]), _steps(client, one["id"])
    assert len(curve_two) == len(curve_one) == 2  # 4 micro-batches of 2 prompts, 2 a step
    for a, b in zip(curve_two, curve_one, strict=True):
        assert a["rewards/v/mean"] == pytest.approx(b["rewards/v/mean"], abs=1e-6)
    assert _checkpoint_steps(client, two["id"]) == _checkpoint_steps(client, one["id"])


EPOCHS = 30  # a job the test stops (pause, cancel): never trained to its end
KILLED_EPOCHS = 10  # 40 steps; the job trains to its end after the restart


def test_a_killed_rank_restarts_the_job_from_its_checkpoint(two_gpu_stack: httpx.Client) -> None:
    client = two_gpu_stack
    train = upload_ok(client, chat_rows(16))
    hp = {"n_epochs": KILLED_EPOCHS, "batch_size": 2, "save_steps": 4, "learning_rate": 1e-3}
    job = _create(
        client, {"training_file": train, "method": _method("supervised", **hp), "resources": {"gpus": 2}}
    )
    job_id = job["id"]
    deadline = time.monotonic() + 180
    while not _checkpoint_steps(client, job_id):
        assert time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.05)
    pids = {rank: trainer_pid(job_id, rank=rank) for rank in (0, 1)}
    assert None not in pids.values(), pids
    for pid in pids.values():  # hold both ranks: the job cannot finish before the kill lands mid-run
        os.kill(pid, signal.SIGSTOP)  # type: ignore[arg-type]
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["current_step"] < 4 * KILLED_EPOCHS
    os.kill(pids[1], signal.SIGKILL)  # type: ignore[arg-type]  # as the OOM killer would
    os.kill(pids[0], signal.SIGCONT)  # type: ignore[arg-type]

    done = wait_for(client, job_id, timeout=300)
    assert done["status"] == "succeeded", done
    events = [e["message"] for e in all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/events")]
    # the surviving rank did not hang: the launcher ended the run, the supervisor requeued the job
    assert any("restart" in m.lower() for m in events), events
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["error"] is None
    resumed = [m for m in events if m.startswith("Resuming from the checkpoint at step")]
    assert len(resumed) == 1, events
    starts = sorted(m for m in events if m.startswith("Job started on worker"))
    assert [m[-len("(attempt 1)") :] for m in starts] == ["(attempt 1)", "(attempt 2)"], starts
    # every step's metrics are there once the job is done: 16 rows / 2 per micro-batch / 2 ranks a step
    assert [r["step"] for r in _steps(client, job_id)] == list(range(1, 4 * KILLED_EPOCHS + 1))
    assert pids[0] is not None and not Path(f"/proc/{pids[0]}").exists()  # the first rank 0 is gone


def _ranks_gone(job_id: str, pids: list[int], timeout: float = 60) -> None:
    """Every rank of the job has exited: none left hanging in a collective."""
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{pid}").exists() for pid in pids) or trainer_pid(job_id) is not None:
        assert time.monotonic() < deadline, f"a rank of {job_id} outlived its job"
        time.sleep(0.1)


def _both_ranks(job_id: str, timeout: float = 180) -> list[int]:
    deadline = time.monotonic() + timeout
    while None in (pids := [trainer_pid(job_id, rank=r) for r in (0, 1)]):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    return [pid for pid in pids if pid is not None]


def test_pause_resume_and_cancel_reach_every_rank(two_gpu_stack: httpx.Client) -> None:
    client = two_gpu_stack
    train = upload_ok(client, chat_rows(16))
    hp = {"n_epochs": EPOCHS, "batch_size": 2, "save_steps": 0, "learning_rate": 1e-3}
    job = _create(
        client, {"training_file": train, "method": _method("supervised", **hp), "resources": {"gpus": 2}}
    )
    job_id = job["id"]
    first = _both_ranks(job_id)
    deadline = time.monotonic() + 120
    while client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["current_step"] < 2:
        assert time.monotonic() < deadline, "the job made no step"
        time.sleep(0.05)

    # pause: rank 0 hears it, every rank stops at the same step, and a checkpoint of that step is kept
    assert client.post(f"/v1/fine_tuning/jobs/{job_id}/pause").status_code == 200
    paused = wait_for(client, job_id, ("paused", "failed", "succeeded"), timeout=120)
    assert paused["status"] == "paused", paused
    _ranks_gone(job_id, first)
    kept = _checkpoint_steps(client, job_id)
    assert kept and 2 <= kept[-1] < 4 * EPOCHS, kept

    # resume: a fresh pair of ranks continues from that checkpoint
    assert client.post(f"/v1/fine_tuning/jobs/{job_id}/resume").status_code == 200
    second = _both_ranks(job_id)
    assert set(second).isdisjoint(first)
    deadline = time.monotonic() + 120
    while client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["current_step"] <= kept[-1]:
        assert time.monotonic() < deadline, "the resumed job made no step"
        time.sleep(0.05)
    events = [e["message"] for e in all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/events")]
    assert f"Resuming from the checkpoint at step {kept[-1]}" in " ".join(events), events

    # cancel: both ranks stop, and the job ends cancelled, not failed by a broken collective
    assert client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").status_code == 200
    _ranks_gone(job_id, second)
    done = client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert (done["status"], done["error"]) == ("cancelled", None), done
    steps = [r["step"] for r in _steps(client, job_id)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 4 * EPOCHS  # each step once


def test_a_job_bigger_than_every_worker_waits_and_says_why(two_gpu_stack: httpx.Client) -> None:
    client = two_gpu_stack
    train = upload_ok(client, chat_rows(8))
    job = _create(
        client,
        {"training_file": train, "method": _method("supervised", n_epochs=1), "resources": {"gpus": 4}},
    )
    assert job["status"] == "queued" and job["queue_position"] == 1
    events = all_pages(client, f"/v1/fine_tuning/jobs/{job['id']}/events")
    waiting = [e for e in events if (e["data"] or {}).get("kind") == "job.waiting_for_worker"]
    assert len(waiting) == 1, events
    assert waiting[0]["level"] == "warning"
    assert waiting[0]["message"] == (
        "Waiting for a worker with 4 GPUs: the largest live worker has 2; "
        "the job stays queued until one joins"
    )
    time.sleep(2)  # the 2-GPU worker never takes it
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "queued"
    assert client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel").status_code == 200
