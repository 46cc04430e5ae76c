"""Checkpoints by time, pruning, and verification: a damaged checkpoint is refused, the one before used."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.trainers.helpers import Recorder
from trainers.core import loop
from trainers.core.checkpoint import (
    MANIFEST,
    STATE_DIR,
    CheckpointError,
    latest_checkpoint,
    load_loop_state,
    verify_checkpoint,
)
from trainers.methods.sft import SFTConfig, train_sft


class SlowSteps(Recorder):
    """Each step takes `seconds` on a fake training clock (the loop's `clock`)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds, self.now = seconds, 0.0

    def clock(self) -> float:
        return self.now

    def on_step(self, row: dict[str, float]) -> None:
        super().on_step(row)
        self.now += self.seconds


def test_save_minutes_checkpoints_by_training_time(
    make_config: Callable[..., SFTConfig],
    demo_rows: list[dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rec = SlowSteps(0.25)
    monkeypatch.setattr(loop, "clock", rec.clock)
    # 0.01 min = 0.6 s: due after 3 steps of 0.25 s, counted from the last checkpoint
    train_sft(make_config(max_steps=8, save_minutes=0.01), demo_rows, callbacks=rec)
    assert [(c.step, c.final) for c in rec.checkpoints] == [(3, False), (6, False), (8, True)]

    # with save_steps too: whichever comes first, and a step checkpoint restarts the time interval
    both = SlowSteps(0.25)
    monkeypatch.setattr(loop, "clock", both.clock)
    config = make_config(max_steps=8, save_minutes=0.01, save_steps=2, output_dir=str(tmp_path / "b"))
    train_sft(config, demo_rows, callbacks=both)
    assert [c.step for c in both.checkpoints] == [2, 4, 6, 8]

    never = SlowSteps(60.0)
    monkeypatch.setattr(loop, "clock", never.clock)
    train_sft(
        make_config(max_steps=4, save_minutes=0.0, output_dir=str(tmp_path / "c")), demo_rows, callbacks=never
    )
    assert [c.final for c in never.checkpoints] == [True]


def test_only_the_newest_resumable_checkpoints_are_kept(
    make_config: Callable[..., SFTConfig], demo_rows: list[dict[str, Any]]
) -> None:
    config = make_config(max_steps=5, save_steps=1, keep_checkpoints=2)
    rec = Recorder()
    train_sft(config, demo_rows, callbacks=rec)
    assert [c.step for c in rec.checkpoints] == [1, 2, 3, 4, 5]
    left = sorted(p.name for p in Path(config.output_dir).iterdir())
    assert left == ["checkpoint-000003", "checkpoint-000004", "checkpoint-000005"]  # 5 is the final export


def test_a_damaged_checkpoint_is_refused_for_the_one_before(
    make_config: Callable[..., SFTConfig], demo_rows: list[dict[str, Any]]
) -> None:
    config = make_config(max_steps=4, save_steps=1, keep_checkpoints=5)
    rec = Recorder()
    train_sft(config, demo_rows, callbacks=rec)
    out = Path(config.output_dir)
    assert latest_checkpoint(out) == out / "checkpoint-000003"  # the final export is not resumable

    optimizer = out / "checkpoint-000003" / STATE_DIR / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:100])  # truncated, as by a full disk
    with pytest.raises(CheckpointError, match=r"optimizer\.pt is 100 bytes"):
        verify_checkpoint(out / "checkpoint-000003")
    with pytest.raises(CheckpointError):
        load_loop_state(out / "checkpoint-000003")
    assert latest_checkpoint(out) == out / "checkpoint-000002"

    (out / "checkpoint-000002" / STATE_DIR / MANIFEST).unlink()  # written last: an incomplete copy
    with pytest.raises(CheckpointError, match="not a complete resumable checkpoint"):
        verify_checkpoint(out / "checkpoint-000002")
    assert latest_checkpoint(out) == out / "checkpoint-000001"

    manifest = json.loads((out / "checkpoint-000001" / STATE_DIR / MANIFEST).read_text())
    assert "model/adapter_model.safetensors" in manifest["files"] and "state/rng.pt" in manifest["files"]
    (out / "checkpoint-000001" / "model" / "adapter_model.safetensors").unlink()
    assert latest_checkpoint(out) is None

    # resuming from a damaged checkpoint fails loudly rather than training from a wrong state
    with pytest.raises(CheckpointError):
        train_sft(make_config(max_steps=4, resume_from=str(out / "checkpoint-000003")), demo_rows)
