"""Online DPO (the judge and the loss on judged pairs: test_advantages.py, test_rl_losses.py): learning;
resume."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from trl.import_utils import TRLExperimentalWarning

from tests.trainers.helpers import RESUME_RUN, Recorder
from tests.trainers.methods.test_grpo import HAS_E_SET, ROWS
from trainers.methods.online_dpo import OnlineDPOConfig, train_online_dpo

with warnings.catch_warnings():  # TRL warns, once, that its experimental trainers may change
    warnings.simplefilter("ignore", TRLExperimentalWarning)


KEYS = {
    "reward",
    "rewards/has_e/mean",
    "frac_pairs_judged",
    "scores_margin",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "completions/mean_length",
}


@pytest.fixture
def odpo_config(tiny_model_path: Path, tmp_path: Path) -> Callable[..., OnlineDPOConfig]:
    def make(**overrides: Any) -> OnlineDPOConfig:
        fields: dict[str, Any] = {
            "model_path": str(tiny_model_path),
            "output_dir": str(tmp_path / "out"),
            "batch_size": 8,
            "max_completion_length": 4,
            "temperature": 1.0,
            "lr_scheduler": "constant",
        }
        return OnlineDPOConfig(**(fields | overrides))

    return make


# -- training -----------------------------------------------------------------------------------------------
def test_online_dpo_reward_rises(odpo_config: Callable[..., OnlineDPOConfig]) -> None:
    rec = Recorder()
    config = odpo_config(use_lora=False, learning_rate=3e-2, beta=0.5, max_steps=16, n_epochs=8)
    result = train_online_dpo(config, ROWS, None, rec, rewards=HAS_E_SET)
    rewards = [r["reward"] for r in rec.steps]
    print(f"\nonline DPO reward: first step {rewards[0]:.3f} -> last step {rewards[-1]:.3f}: {rewards}")
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.3, rewards
    assert rewards[-1] >= 0.875
    assert all(set(r) >= KEYS for r in rec.steps)
    judged = [r for r in rec.steps if r["frac_pairs_judged"] > 0]
    assert judged and all(r["scores_margin"] == 1.0 for r in judged)  # 0/1 grader: y_w scored 1, y_l 0
    assert rec.steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)  # the policy is the reference
    assert result.final_checkpoint is not None and result.final_checkpoint.final


def test_resume_repeats_the_uninterrupted_run(
    odpo_config: Callable[..., OnlineDPOConfig], tmp_path: Path
) -> None:
    run = RESUME_RUN | {"lora_dropout": 0.1, "learning_rate": 2e-2, "missing_eos_penalty": 0.5}
    full = Recorder()
    train_online_dpo(odpo_config(**run, output_dir=str(tmp_path / "a")), ROWS, None, full, rewards=HAS_E_SET)
    assert [(c.step, c.final) for c in full.checkpoints] == [(3, False), (6, True)]
    resumed = Recorder()
    config = odpo_config(**run, output_dir=str(tmp_path / "b"), resume_from=str(full.checkpoints[0].path))
    train_online_dpo(config, ROWS, None, resumed, rewards=HAS_E_SET)
    assert [int(r["step"]) for r in resumed.steps] == [4, 5, 6]
    for ours, theirs in zip(resumed.steps, full.steps[3:], strict=True):
        for key in (
            "loss",
            "reward",
            "rewards/margins",
            "scores_margin",
            "grad_norm",
            "learning_rate",
            "epoch",
        ):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-6), key
