"""worker/trackers.py without a stack: the TensorBoard event files a `tensorboard` integration yields,
and a W&B run that breaks while training (its cloud cannot be reached here: a stand-in run object that
raises plays the outage) never stops the training."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

import pytest

from tests.tracker_files import tensorboard_events, tensorboard_scalars
from worker.trackers import WandbRun, tar_events, write_tensorboard


def test_tensorboard_event_files_hold_every_metric_at_its_step(tmp_path: Path) -> None:
    rows = [
        (1, {"loss": 2.5, "reward": 0.25, "logged_at": 1e9}),
        (2, {"loss": 2.0, "reward": 0.5, "valid_reward": 0.75, "valid_reward/has_e": 0.75}),
    ]
    write_tensorboard(rows, {"method": "grpo", "seed": 1}, tmp_path / "tb")
    assert tensorboard_scalars(tmp_path / "tb") == {
        ("loss", 1): 2.5,
        ("reward", 1): 0.25,
        ("loss", 2): 2.0,
        ("reward", 2): 0.5,
        ("valid_reward", 2): 0.75,
        ("valid_reward/has_e", 2): 0.75,
    }
    values = [v for e in tensorboard_events(tmp_path / "tb") for v in e.summary.value]
    [config] = [v.tensor.string_val[0].decode() for v in values if v.tag.startswith("config")]
    assert '"method": "grpo"' in config

    tar_events(tmp_path / "tb", tmp_path / "tb.tar.gz")
    with tarfile.open(tmp_path / "tb.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.startswith("tensorboard/events.out.tfevents.") for n in names), names


class BrokenRun:
    """Stands in for a W&B run whose backend went away mid-training."""

    def __init__(self) -> None:
        self.logged: list[dict[str, Any]] = []
        self.finished: int | None = None

    def log(self, values: dict[str, Any], *, step: int) -> None:
        if step > 1:
            raise ConnectionError("wandb backend unreachable")
        self.logged.append({**values, "_step": step})

    def finish(self, *, exit_code: int) -> None:
        self.finished = exit_code


def test_a_wandb_run_that_breaks_stops_logging_without_raising(caplog: pytest.LogCaptureFixture) -> None:
    run = BrokenRun()
    tracker = WandbRun(run, job_id="ftjob-x")
    for step in (1, 2, 3):
        tracker.log({"step": float(step), "loss": 1.0 / step, "total_steps": 3.0, "logged_at": 0.0})
    assert run.logged == [{"loss": 1.0, "_step": 1}]  # step is W&B's axis; bookkeeping keys are not logged
    assert tracker.broken == "ConnectionError: wandb backend unreachable"
    assert "W&B logging stopped" in caplog.text
    tracker.finish(exit_code=0)
    assert run.finished == 0
