"""RLOO: advantages and loss equal TRL's; learning; resume."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from trl.trainer.rloo_trainer import RLOOTrainer
from trl.trainer.utils import nanstd as trl_nanstd

from tests.trainers.helpers import RESUME_RUN, Recorder
from tests.trainers.test_grpo import HAS_E_SET, ROWS
from trainers.rloo import RLOOConfig, rloo_advantages, rloo_loss, sequence_kl, train_rloo

RL_KEYS = {
    "reward",
    "reward_std",
    "rewards/has_e/mean",
    "completions/mean_length",
    "completions/clipped_ratio",
    "clip_ratio",
    "entropy",
}


@pytest.fixture
def rloo_config(tiny_model_path: Path, tmp_path: Path) -> Callable[..., RLOOConfig]:
    def make(**overrides: Any) -> RLOOConfig:
        fields: dict[str, Any] = {
            "model_path": str(tiny_model_path),
            "output_dir": str(tmp_path / "out"),
            "batch_size": 4,
            "num_generations": 4,
            "max_completion_length": 4,
            "lr_scheduler": "constant",
        }
        return RLOOConfig(**(fields | overrides))

    return make


# -- exactness against TRL 1.16 -----------------------------------------------------------------------------
def trl_advantages(
    rewards: torch.Tensor,
    k: int,
    *,
    normalize: bool,
    beta: float = 0.0,
    old: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """trl/trainer/rloo_trainer.py (1.16) lines 1663-1699 (KL penalty, leave-one-out baseline,
    normalisation), after the weighted sum; that code is inline in `_generate_and_score_completions`, so it
    is copied here verbatim except for `self.`, `gather` (one process) and the k = 1 branch."""
    if beta != 0.0:
        assert old is not None and ref is not None and mask is not None
        per_token_kl = old - ref
        kl = (per_token_kl * mask).sum(-1)
        rewards = rewards - beta * kl
    grouped_rewards = rewards.view(-1, k)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)  # (num_prompts, 1)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)  # (num_prompts, 1)
    baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)  # (num_prompts, num_generations)
    baselines = baselines.view(-1)  # Flatten back to match rewards shape
    advantages = rewards - baselines
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (trl_nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_rloo_advantages_equal_trl(normalize: bool, beta: float) -> None:
    torch.manual_seed(0)
    k, n = 4, 24
    rewards = torch.randn(n)
    rewards[4:8] = 1.0  # a group with zero spread
    rewards[9] = float("nan")  # unscored completion
    rewards[13:16] = float("nan")  # a group with a single scored completion
    old, ref = torch.randn(n, 5) - 2, torch.randn(n, 5) - 2
    mask = (torch.arange(5) < torch.randint(1, 6, (n, 1))).long()
    theirs = trl_advantages(rewards, k, normalize=normalize, beta=beta, old=old, ref=ref, mask=mask)
    kl = sequence_kl(old, ref, mask)
    ours = rloo_advantages(rewards, k, kl=kl, beta=beta, normalize=normalize)
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert ours[9] == 0 and torch.all(ours[12:16] == 0)
    if not normalize and beta == 0.0:
        assert torch.all(ours[4:8] == 0)
        # the leave-one-out baseline, written out: A_i = r_i - mean of the others
        r = rewards[:4]
        assert ours[0] == pytest.approx(float(r[0] - r[1:].mean()), abs=1e-6)
    assert torch.allclose(kl, ((old - ref) * mask).sum(1))


class _Accelerator:
    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def reduce(self, t: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return t


def trl_loss(
    logps: torch.Tensor,
    old_seq: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float,
    epsilon_high: float,
) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """TRL's own `RLOOTrainer._compute_loss`, called on a stand-in `self` whose model forward returns our
    per-token log-probs (one process, no auxiliary loss)."""
    metrics: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        aux_loss_enabled=False,
        epsilon_low=epsilon,
        epsilon_high=epsilon_high,
        model=SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        _metrics=metrics,
    )
    b, t = logps.shape
    inputs = {
        "prompt_ids": torch.zeros(b, 2, dtype=torch.long),
        "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.zeros(b, t, dtype=torch.long),
        "completion_mask": mask,
        "old_logps": old_seq,
        "advantages": adv,
    }
    loss = RLOOTrainer._compute_loss(stub, None, inputs)  # type: ignore[arg-type,no-untyped-call]
    return loss, metrics["train"]


@pytest.mark.parametrize(("epsilon_high", "spread"), [(0.2, 0.0), (0.2, 0.3), (0.28, 0.3)])
def test_rloo_loss_equals_trl(epsilon_high: float, spread: float) -> None:
    torch.manual_seed(1)
    b, t = 8, 7
    logps = (torch.randn(b, t) - 2).requires_grad_()
    mask = (torch.arange(t) < torch.tensor([7, 5, 1, 3, 7, 2, 4, 6]).unsqueeze(1)).long()
    # spread 0: the first step on a rollout (ρ = 1); else a reused rollout, ratios outside the clip range
    old = (logps.detach() * mask).sum(1) + spread * torch.randn(b)
    adv = torch.randn(b)
    ours, metrics = rloo_loss(logps, old, adv, mask, epsilon=0.2, epsilon_high=epsilon_high)
    theirs, trl_metrics = trl_loss(logps, old, adv, mask, epsilon=0.2, epsilon_high=epsilon_high)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)
    grad_ours = torch.autograd.grad(ours, logps)[0]
    grad_theirs = torch.autograd.grad(theirs, logps)[0]
    assert torch.allclose(grad_ours, grad_theirs, atol=1e-6)
    assert metrics["clip_ratio"] == pytest.approx(trl_metrics["clip_ratio/region_mean"][0], abs=1e-6)
    if spread == 0.0:
        # ρ = 1: the REINFORCE gradient, -A_i/N on each of sequence i's masked tokens (the paper's eq. 6)
        assert torch.allclose(grad_ours, -(adv / b).unsqueeze(1) * mask, atol=1e-6)
        assert metrics["clip_ratio"] == 0.0
    else:
        assert metrics["clip_ratio"] > 0


# -- training -----------------------------------------------------------------------------------------------
def test_rloo_reward_rises(rloo_config: Callable[..., RLOOConfig]) -> None:
    rec = Recorder()
    config = rloo_config(use_lora=False, learning_rate=2e-2, beta=0.0, max_steps=16, n_epochs=4)
    result = train_rloo(config, ROWS, None, rec, rewards=HAS_E_SET)
    rewards = [r["reward"] for r in rec.steps]
    print(f"\nRLOO reward: first step {rewards[0]:.3f} -> last step {rewards[-1]:.3f}: {rewards}")
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.3, rewards
    assert rewards[-1] >= 0.875
    assert all(set(r) >= RL_KEYS for r in rec.steps)
    assert result.final_checkpoint is not None and result.final_checkpoint.final


def test_resume_repeats_the_uninterrupted_run(rloo_config: Callable[..., RLOOConfig], tmp_path: Path) -> None:
    # 8 prompts, 4 a step, each rollout trained on twice: step 3 is mid-rollout and 6 steps cross an epoch
    run = RESUME_RUN | {"num_iterations": 2, "lora_dropout": 0.1, "learning_rate": 2e-2, "epsilon_high": 0.28}
    rows = ROWS[:8]
    full = Recorder()
    train_rloo(rloo_config(**run, output_dir=str(tmp_path / "a")), rows, None, full, rewards=HAS_E_SET)
    assert [(c.step, c.final) for c in full.checkpoints] == [(3, False), (6, True)]
    assert full.epochs and full.epochs[0][1] == 4
    resumed = Recorder()
    config = rloo_config(**run, output_dir=str(tmp_path / "b"), resume_from=str(full.checkpoints[0].path))
    train_rloo(config, rows, None, resumed, rewards=HAS_E_SET)
    assert [int(r["step"]) for r in resumed.steps] == [4, 5, 6]
    for ours, theirs in zip(resumed.steps, full.steps[3:], strict=True):
        for key in ("loss", "reward", "kl", "clip_ratio", "grad_norm", "learning_rate", "epoch"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-6), key
    assert full.steps[2]["reward"] == full.steps[3]["reward"]  # steps 3 and 4 share a rollout
    assert full.steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    # sampled from the policy, the summed log-ratio estimates KL(π || π_ref) >= 0: the policy has drifted
    assert all(r["kl"] > 0.0 for r in full.steps[2:]), [r["kl"] for r in full.steps]
