"""An RL job with a validation file and experiment trackers, through API + Celery worker on
PostgreSQL/Redis: `valid_reward` (the grader on the policy's greedy completions of the validation
prompts) in the metrics, the checkpoints and the events, apart from the training reward; the job's
config and every metric row in its W&B run, and the same rows as TensorBoard event files in a
downloadable result file. W&B runs in its own offline mode (tests/conftest.py sets
WANDB_MODE=offline: its cloud cannot be reached here) and the test reads the offline run file back.

A worker without a tracker's package fails the job, before training, with `integration_unavailable`:
shown with the worker's supervisor and a real trainer process whose `tensorboardX` import fails.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import httpx
import pytest
from sqlalchemy import update

from service.config import get_settings
from service.db import session_scope
from service.models import Job
from tests.conftest import DATA_DIR
from tests.e2e.test_rl_methods import HAS_E, MODEL, RL_HP, ROWS
from tests.helpers import all_pages, upload_ok, wait_for
from tests.tracker_files import read_offline_run, tensorboard_scalars
from worker.supervisor import supervise_job

VALID = [{"prompt": p, "answer": "e"} for p in ("Lima is", "Blue", "One, two,", "The sea")]


def test_rl_validation_reaches_metrics_checkpoints_events_and_trackers(
    stack_client: httpx.Client, tmp_path: Path
) -> None:
    hp = {**RL_HP, "num_generations": 2, "max_steps": 3, "eval_steps": 2}
    wandb = {"project": "tunehouse-ci", "name": "rl-eval", "tags": ["ci"]}
    created = stack_client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": MODEL,
            "training_file": upload_ok(stack_client, ROWS),
            "validation_file": upload_ok(stack_client, VALID),
            "seed": 1,
            "method": {"type": "grpo", "grpo": {"grader": HAS_E, "hyperparameters": hp}},
            "integrations": [{"type": "wandb", "wandb": wandb}, {"type": "tensorboard"}],
        },
    )
    assert created.status_code == 200, created.text
    job = wait_for(stack_client, created.json()["id"], timeout=300)
    assert job["status"] == "succeeded", job
    job_id = job["id"]

    metrics = {m["step"]: m for m in all_pages(stack_client, f"/v1/fine_tuning/jobs/{job_id}/metrics")}
    assert sorted(metrics) == [1, 2, 3]
    assert [s for s, m in metrics.items() if "valid_reward" in m] == [2, 3]  # eval_steps, then the end
    for step in (2, 3):
        row = metrics[step]
        # one grader of weight 1 on 4 validation prompts: its mean is the total, a multiple of 1/4
        assert row["valid_reward"] == row["valid_reward/has_e"]
        assert (4 * row["valid_reward"]).is_integer() and 0 <= row["valid_reward"] <= 1
    assert all("reward" in m and "valid_loss" not in m for m in metrics.values())

    checkpoints = stack_client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    final = next(c for c in checkpoints if c["is_final"])
    assert final["metrics"]["valid_reward"] == metrics[3]["valid_reward"]
    assert final["metrics"]["valid_reward/has_e"] == metrics[3]["valid_reward/has_e"]

    events = all_pages(stack_client, f"/v1/fine_tuning/jobs/{job_id}/events")
    graded = [e for e in events if e["type"] == "metrics" and "valid_reward" in (e["data"] or {})]
    assert sorted(e["data"]["step"] for e in graded) == [2, 3]
    assert all("valid_reward=" in e["message"] for e in graded)

    # the W&B run: named and tagged as asked, the job's config, every step's metrics at their step
    assert job["integrations"] == [{"type": "wandb", "wandb": wandb}, {"type": "tensorboard"}]
    [path] = (DATA_DIR / "wandb").glob(f"offline-run-*-{job_id}/run-{job_id}.wandb")
    run = read_offline_run(path)
    assert (run.run_id, run.project, run.name) == (job_id, "tunehouse-ci", "rl-eval")
    assert {"ci", "tunehouse/finetune", f"tunehouse/{job_id}"} <= set(run.tags)
    assert run.config["method"] == "grpo" and run.config["hyperparameters"]["eval_steps"] == 2
    assert run.config["validation_file"] == job["validation_file"]
    assert sorted(run.history) == [1, 2, 3]
    for step, row in metrics.items():
        logged = run.history[step]
        for key in ("loss", "reward", "rewards/has_e/mean", "valid_reward", "valid_reward/has_e"):
            assert logged.get(key) == row.get(key), (step, key)
    assert run.exit_code == 0
    # the tensorboard result file: the same rows as event files, a tar a client downloads
    files = [stack_client.get(f"/v1/files/{f}").json() for f in job["result_files"]]
    [tb] = [f for f in files if f["filename"] == "tensorboard.tar.gz"]
    assert tb["purpose"] == "fine-tune-results"
    content = stack_client.get(f"/v1/files/{tb['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(content.content)) as tar:
        tar.extractall(tmp_path, filter="data")
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    for step, row in metrics.items():
        for key in ("loss", "reward", "valid_reward", "valid_reward/has_e"):
            if key in row:  # event files hold float32 scalars
                assert scalars.pop((key, step)) == pytest.approx(row[key], rel=1e-6), (step, key)
    assert ("loss", 4) not in scalars


def test_a_worker_without_the_trackers_package_fails_the_job_clearly(
    client: httpx.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the API-only server's broker has no worker: the job waits queued until this test runs it
    created = client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": MODEL,
            "training_file": upload_ok(client, ROWS),
            "method": {"type": "grpo", "grpo": {"grader": HAS_E, "hyperparameters": RL_HP}},
            "integrations": [{"type": "tensorboard"}],
        },
    )
    assert created.status_code == 200, created.text
    job_id = created.json()["id"]
    # a queue of this job alone: the supervisor claims the fairest job of its queue, and the idle
    # server's queue holds other tests' waiting jobs
    own_queue = f"trackers-{job_id}"
    with session_scope() as session:
        session.execute(update(Job).where(Job.id == job_id).values(queue=own_queue))
    monkeypatch.setenv("TUNEHOUSE_JOB_QUEUE", own_queue)
    get_settings.cache_clear()
    # a package that fails to import, first on the path: the trainer process as if tensorboardX were
    # missing; the supervisor (claim, heartbeat, trainer process) is the worker's own
    shadow = tmp_path / "tensorboardX"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'tensorboardX'\")\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.getcwd()]))
    try:
        assert supervise_job(job_id, worker_id="test-worker:1") == "failed"
    finally:
        monkeypatch.delenv("TUNEHOUSE_JOB_QUEUE")
        get_settings.cache_clear()
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["status"] == "failed" and job["error"]["code"] == "integration_unavailable", job
    assert job["error"]["param"] == "integrations[0]"
    assert "tensorboardX" in job["error"]["message"] and "tunehouse[trackers]" in job["error"]["message"]
    assert job["trained_tokens"] is None and job["current_step"] == 0  # refused before training
