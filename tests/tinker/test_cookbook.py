"""tinker-cookbook 0.6.1 (installed by `make setup` beside the pinned `tinker` SDK) runs unchanged against
a real uvicorn server and Tinker host: its supervised loop on a conversation file, its RL loop with
`stable_reinforce` on a small env, DPO, and a resume, each in its own process (tests/tinker/cookbook_runs.py)
and each to exit status 0 with a quiet terminal (the SDK's telemetry on, the session finished on close).

The recipes name a hub model (cookbook_runs.MODEL): the server serves the tiny model under that name
through TUNEHOUSE_MODEL_REGISTRY, and the cookbook's tokenizer loads it from an offline Hugging Face cache
built here from the tiny model's own files (HF_HUB_OFFLINE=1: nothing is downloaded).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import _stop, new_key, start_server
from tests.helpers import start_tinker_host

pytest.importorskip("tinker_cookbook")  # `make setup` installs it (Makefile: no-deps, pinned)
from tests.tinker.cookbook_runs import MODEL

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # see test_sdk
RECIPE_TIMEOUT = 300


def _hub_cache(model_dir: Path, cache: Path, name: str) -> None:
    """`name` in a Hugging Face hub cache, as a download would have left it: the tiny model's tokenizer
    and config (no weights: the cookbook reads only the tokenizer on the client side)."""
    revision = "0" * 40
    repo = cache / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in model_dir.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors"):
            shutil.copy(file, snapshot / file.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


@dataclass
class Cookbook:
    env: dict[str, str]
    runs: Path

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tests.tinker.cookbook_runs", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=RECIPE_TIMEOUT,
            cwd=Path(__file__).parents[2],
        )


@pytest.fixture(scope="module")
def cookbook() -> Iterator[Cookbook]:
    from trainers.modeling.tiny_model import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="tunehouse-cookbook-"))
    model_dir = build_tiny_model(root / "tiny")
    _hub_cache(model_dir, root / "hub", MODEL)
    registry = json.dumps({MODEL: str(model_dir)})
    server_env = {"TUNEHOUSE_MODEL_REGISTRY": registry}
    url, api = start_server(server_env)
    host_env = {**os.environ, **server_env, "OMP_NUM_THREADS": "1"}
    host = start_tinker_host(host_env)
    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("TINKER_", "TUNEHOUSE_"))
    } | {
        "TINKER_BASE_URL": url,
        "TINKER_API_KEY": f"tml-{new_key()}",
        "HF_HUB_CACHE": str(root / "hub"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    yield Cookbook(env=env, runs=root / "runs")
    _stop(host)
    _stop(api)
    gc.collect()
    shutil.rmtree(root, ignore_errors=True)


def _metrics(log_path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def _assert_clean(done: subprocess.CompletedProcess[str]) -> None:
    """Exit status 0 and nothing alarming on the terminal: no traceback, no telemetry complaint."""
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    for alarming in ("Traceback", "telemetry", "404 Not Found", "ERROR"):
        assert alarming not in output, (alarming, output[-4000:])


def test_supervised_loop_on_a_conversation_file_then_resume(cookbook: Cookbook) -> None:
    first = cookbook.run("sft", str(cookbook.runs / "sft"))
    _assert_clean(first)
    nll = [m["train_mean_nll"] for m in _metrics(cookbook.runs / "sft")]
    assert len(nll) == 6 and nll[-1] < nll[0], nll
    # the run's last saved state (the cookbook's checkpoints.jsonl), loaded by a new run: it starts
    # where the first one ended, not from the base
    saved = [
        json.loads(line) for line in (cookbook.runs / "sft" / "checkpoints.jsonl").read_text().splitlines()
    ]
    state = saved[-1]["state_path"]
    assert state.startswith("tinker://")
    resumed = cookbook.run("sft", str(cookbook.runs / "resumed"), "1", state)
    _assert_clean(resumed)
    (again,) = [m["train_mean_nll"] for m in _metrics(cookbook.runs / "resumed")]
    assert again < nll[0] and again == pytest.approx(nll[-1], rel=0.5), (nll, again)


def test_rl_loop_with_stable_reinforce(cookbook: Cookbook) -> None:
    log_path = cookbook.runs / "rl"
    done = cookbook.run("rl", str(log_path))
    _assert_clean(done)
    rewards = [m["env/all/reward/total"] for m in _metrics(log_path) if "env/all/reward/total" in m]
    assert len(rewards) == 4, rewards


def test_dpo(cookbook: Cookbook) -> None:
    log_path = cookbook.runs / "dpo"
    done = cookbook.run("dpo", str(log_path))
    _assert_clean(done)
    losses = [m["dpo_loss"] for m in _metrics(log_path) if "dpo_loss" in m]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses


def test_an_error_inside_a_run_reaches_the_user(cookbook: Cookbook, tmp_path: Path) -> None:
    """A run that fails inside (its model is not served) ends with that error, not the session's close."""
    env = {**cookbook.env, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import asyncio, chz; from tests.tinker import cookbook_runs as c; "
            f"cfg = chz.replace(c.sft_config({str(tmp_path)!r}), model_name='tunehouse/no-such-model'); "
            "asyncio.run(c.sl_train.main(cfg))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=RECIPE_TIMEOUT,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode != 0
    assert "no model 'tunehouse/no-such-model'" in done.stderr, done.stderr[-3000:]
    assert "finish" not in done.stderr, done.stderr[-3000:]
