"""An RL job's python grader runs in the sandbox on the worker too (worker/graders.py builds it with the
operator's settings), and a training worker with python graders enabled does not start on a host that
cannot build the sandbox (worker/celery_app.py), unless the operator chose to run without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.config import Settings
from service.jobs.spec import load_method
from service.storage import LocalBlobStore
from tests.trainers.rewards.sandbox_probes import PROBES, victim
from trainers.rewards.graders import GraderError
from worker.graders import reward_set


def test_the_workers_python_grader_is_sandboxed(tmp_path: Path) -> None:
    grader = {"type": "python", "name": "probe", "source": PROBES["read /proc/*/environ of the service"]}
    method = load_method({"type": "grpo", "grpo": {"grader": grader, "hyperparameters": {}}})

    def score(settings: Settings) -> list[float | None]:
        rewards = reward_set(method, settings=settings, blobs=LocalBlobStore(tmp_path), tenant_id="t")
        assert rewards is not None
        return list(rewards.funcs[0](["q"], ["a"], secret=[secret]))

    secret = f"s3cret-{os.urandom(4).hex()}"
    service = victim(secret, "worker")
    try:
        with pytest.raises(GraderError, match="no environment holds the secret"):
            score(Settings(allow_python_grader=True))
        assert score(Settings(allow_python_grader=True, python_grader_unsafe_no_sandbox=True)) == [1.0]
    finally:
        service.kill()
        service.wait()


def test_a_worker_refuses_to_start_without_a_sandbox(tmp_path: Path) -> None:
    env = {**os.environ, "TUNEHOUSE_ALLOW_PYTHON_GRADER": "1", "PATH": str(tmp_path)}
    worker = [sys.executable, "-m", "tunehouse.cli", "worker", "--loglevel", "warning"]
    refused = subprocess.run(worker, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode != 0
    assert "which this host cannot provide: bubblewrap is not installed" in refused.stderr, refused.stderr
