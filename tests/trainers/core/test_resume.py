"""Exact resume, cancel and pause: a run resumed at step k repeats the uninterrupted run's steps k+1.."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.trainers.helpers import RESUME_RUN, Recorder
from trainers.core.loop import StopRequest
from trainers.methods.sft import SFTConfig, train_sft

RUN = RESUME_RUN


@pytest.mark.parametrize(
    "method",
    [
        {"use_lora": True, "lora_dropout": 0.1, "learning_rate": 1e-2},
        {"use_lora": False, "learning_rate": 1e-3},
    ],
    ids=["lora", "full"],
)
def test_resume_repeats_the_uninterrupted_run(
    make_config: Callable[..., SFTConfig],
    demo_rows: list[dict[str, Any]],
    tmp_path: Path,
    method: dict[str, Any],
) -> None:
    rows = demo_rows[:16]
    full = Recorder()
    result = train_sft(make_config(**RUN, **method, output_dir=str(tmp_path / "a")), rows, rows[:4], full)
    assert [(c.step, c.final) for c in full.checkpoints] == [(3, False), (6, True)]
    mid = full.checkpoints[0].path
    assert mid.name == "checkpoint-000003" and (mid / "state" / "trainer_state.json").is_file()

    resumed = Recorder()
    config = make_config(**RUN, **method, output_dir=str(tmp_path / "b"), resume_from=str(mid))
    again = train_sft(config, rows, rows[:4], resumed)
    assert resumed.begin["total_steps"] == 6
    assert [int(r["step"]) for r in resumed.steps] == [4, 5, 6]
    for ours, theirs in zip(resumed.steps, full.steps[3:], strict=True):
        for key in ("loss", "learning_rate", "grad_norm", "epoch", "trained_tokens", "mean_token_accuracy"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-6), key
    assert resumed.evals[-1]["valid_loss"] == pytest.approx(full.evals[-1]["valid_loss"], abs=1e-6)
    assert resumed.epochs == [(e, s) for e, s in full.epochs if s > 3]
    assert result.final_checkpoint is not None and again.final_checkpoint is not None
    a = load_file(result.final_checkpoint.path / "model" / "model.safetensors")
    b = load_file(again.final_checkpoint.path / "model" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_cancel_stops_at_once_without_a_checkpoint(
    make_config: Callable[..., SFTConfig], demo_rows: list[dict[str, Any]]
) -> None:
    rec = Recorder(stop_after={2: StopRequest.CANCEL})
    config = make_config(max_steps=10, save_steps=5)
    result = train_sft(config, demo_rows, callbacks=rec)
    assert result.stopped is StopRequest.CANCEL
    assert result.steps == 2 and len(rec.steps) == 2
    assert result.final_checkpoint is None and rec.checkpoints == []
    assert not Path(config.output_dir).exists() or list(Path(config.output_dir).iterdir()) == []


def test_pause_writes_a_checkpoint_that_resumes(
    make_config: Callable[..., SFTConfig], demo_rows: list[dict[str, Any]], tmp_path: Path
) -> None:
    rec = Recorder(stop_after={2: StopRequest.PAUSE})
    result = train_sft(make_config(max_steps=4, output_dir=str(tmp_path / "a")), demo_rows, callbacks=rec)
    assert result.stopped is StopRequest.PAUSE and result.steps == 2
    ckpt = result.final_checkpoint
    assert ckpt is not None and not ckpt.final and ckpt.step == 2
    assert rec.checkpoints == [ckpt]
    assert (ckpt.path / "model" / "adapter_model.safetensors").is_file()
    assert (ckpt.path / "state" / "optimizer.pt").is_file()

    rest = Recorder()
    config = make_config(max_steps=4, output_dir=str(tmp_path / "a"), resume_from=str(ckpt.path))
    done = train_sft(config, demo_rows, callbacks=rest)
    assert [int(r["step"]) for r in rest.steps] == [3, 4]
    assert done.stopped is None and done.final_checkpoint is not None and done.final_checkpoint.final

    uninterrupted = Recorder()
    train_sft(make_config(max_steps=4, output_dir=str(tmp_path / "c")), demo_rows, callbacks=uninterrupted)
    assert rec.losses + rest.losses == pytest.approx(uninterrupted.losses, abs=1e-6)
