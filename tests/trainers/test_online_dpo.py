"""Online DPO: loss equals TRL's on judged pairs; ties and unscored pairs; learning; resume."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from trl.import_utils import TRLExperimentalWarning

from tests.trainers.helpers import RESUME_RUN, Recorder
from tests.trainers.test_grpo import HAS_E_SET, ROWS
from trainers.online_dpo import OnlineDPOConfig, judge_pairs, online_dpo_loss, train_online_dpo

with warnings.catch_warnings():  # TRL warns, once, that its experimental trainers may change
    warnings.simplefilter("ignore", TRLExperimentalWarning)
    from trl.experimental.online_dpo import OnlineDPOTrainer


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


# -- exactness against TRL 1.16 -----------------------------------------------------------------------------
def trl_step(
    token_logps: torch.Tensor,
    ref_token_logps: torch.Tensor,
    mask: torch.Tensor,
    scores: torch.Tensor,
    *,
    beta: float,
    loss_type: str,
) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """TRL's own `OnlineDPOTrainer.training_step` on a stand-in `self`: generation returns fixed
    completions, the forward passes return our per-token log-probs (policy, then reference), the reward
    functions return ``scores``; the loss is taken where TRL hands it to `accelerator.backward`.

    TRL lays out a step's 2B completions as [first samples of all prompts, second samples]; inputs here
    are in that layout."""
    n = token_logps.size(0) // 2
    policy = SimpleNamespace(train=lambda: None, disable_adapter=nullcontext)
    losses: list[torch.Tensor] = []
    stats: dict[str, list[float]] = defaultdict(list)
    completion_ids = torch.where(mask.bool(), 5, 0)
    completion_ids[:, -1] = torch.where(mask[:, -1].bool(), 5, 2)  # EOS (2) in every completion
    stub = SimpleNamespace(
        args=SimpleNamespace(
            use_vllm=False,
            missing_eos_penalty=None,
            loss_type=loss_type,
            torch_empty_cache_steps=None,
            optim="adamw_torch",
            n_gpu=1,
            gradient_accumulation_steps=1,
        ),
        _generate=lambda *a: (
            torch.zeros(2 * n, 2, dtype=torch.long),
            torch.ones(2 * n, 2),
            completion_ids,
            mask,
            None,
        ),
        eos_token_ids=[2],
        _forward=lambda model, *a: token_logps if model is policy else ref_token_logps,
        ref_model=SimpleNamespace(),
        model=policy,
        processing_class=SimpleNamespace(batch_decode=lambda ids, **k: ["x"] * len(ids)),
        _calculate_rewards_from_functions=lambda **k: scores,
        reward_funcs=[object()],
        accelerator=SimpleNamespace(gather_for_metrics=lambda t: t, backward=losses.append),
        stats=stats,
        beta=beta,
        state=SimpleNamespace(global_step=1),
    )
    OnlineDPOTrainer.training_step(stub, policy, {"prompt": ["p"] * n})  # type: ignore[arg-type]
    return losses[0], stats


def interleave(x: torch.Tensor) -> torch.Tensor:
    """TRL's [a_0..a_{B-1}, b_0..b_{B-1}] -> ours, each prompt's two completions adjacent."""
    first, second = x.chunk(2)
    return torch.stack([first, second], dim=1).flatten(0, 1)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_online_dpo_loss_equals_trl(loss_type: str) -> None:
    torch.manual_seed(2)
    b, t, beta = 6, 5, 0.1
    token_logps = (torch.randn(2 * b, t) - 2).requires_grad_()
    ref_token_logps = token_logps.detach() + 0.5 * torch.randn(2 * b, t)
    mask = (torch.arange(t) < torch.randint(1, t + 1, (2 * b, 1))).long()
    scores = torch.tensor([0.3, 1.0, -2.0, 0.5, 0.0, 4.0, 0.2, 0.1, 1.5, -1.0, 0.9, 3.0])  # no ties
    theirs, stats = trl_step(token_logps, ref_token_logps, mask, scores, beta=beta, loss_type=loss_type)

    pairs = judge_pairs(interleave(scores))
    assert pairs.judged.all()
    logps = interleave((token_logps * mask).sum(1))
    ref = interleave((ref_token_logps * mask).sum(1))
    losses, chosen_rewards, rejected_rewards = online_dpo_loss(
        logps, ref, pairs, beta=beta, loss_type=loss_type
    )
    ours = losses.mean()
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)
    grad_ours = torch.autograd.grad(ours, token_logps, retain_graph=True)[0]
    grad_theirs = torch.autograd.grad(theirs, token_logps)[0]
    assert torch.allclose(grad_ours, grad_theirs, atol=1e-6)
    assert chosen_rewards.mean().item() == pytest.approx(stats["rewards/chosen"][0], abs=1e-6)
    assert rejected_rewards.mean().item() == pytest.approx(stats["rewards/rejected"][0], abs=1e-6)
    margins = (chosen_rewards - rejected_rewards).mean().item()
    assert margins == pytest.approx(stats["rewards/margins"][0], abs=1e-6)
    s = interleave(scores)
    assert (s[pairs.chosen] - s[pairs.rejected]).mean().item() == pytest.approx(
        stats["objective/scores_margin"][0], abs=1e-6
    )
    assert logps[pairs.chosen].mean().item() == pytest.approx(stats["logps/chosen"][0], abs=1e-5)


def test_the_paper_loss_written_out_and_unjudged_pairs() -> None:
    """-log σ(β[(log π(y_w) - log π_ref(y_w)) - (log π(y_l) - log π_ref(y_l))]) on the higher-scored y_w;
    a tie or an unscored completion: no loss, no gradient."""
    logps = torch.tensor([-3.0, -1.0, -2.0, -2.5, -1.0, -4.0, -2.0, -2.0], requires_grad=True)
    ref = torch.tensor([-2.0, -2.0, -2.0, -2.0, -1.5, -1.5, -2.0, -2.0])
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, float("nan"), 1.0])
    pairs = judge_pairs(scores)
    assert pairs.judged.tolist() == [True, True, False, False]
    losses, _, _ = online_dpo_loss(logps, ref, pairs, beta=0.5)
    h0 = (-3.0 - -2.0) - (-1.0 - -2.0)  # completion 0 chosen over 1
    h1 = (-2.5 - -2.0) - (-2.0 - -2.0)  # completion 3 chosen over 2
    expected = [-torch.nn.functional.logsigmoid(torch.tensor(0.5 * h)).item() for h in (h0, h1)]
    assert losses.tolist() == pytest.approx([*expected, 0.0, 0.0], abs=1e-6)
    (grad,) = torch.autograd.grad(losses.sum(), logps)
    assert torch.all(grad[4:] == 0) and torch.all(grad[:4] != 0)
    with pytest.raises(ValueError, match="loss_type"):
        online_dpo_loss(logps, ref, pairs, beta=0.5, loss_type="hinge")


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
