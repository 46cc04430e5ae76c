"""Objectives of the online RL methods (trainers/losses/rl.py): GRPO's, RLOO's and online DPO's losses,
gradients and metrics equal TRL's own code on the same tensors; PPO's equal the paper's equations written
out. Pure tensor tests, fast enough for the mutation check."""

from __future__ import annotations

import doctest
import warnings
from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from trl.import_utils import TRLExperimentalWarning
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.rloo_trainer import RLOOTrainer

import trainers.losses.rl
from tests.trainers.losses.test_advantages import LENGTHS, completion_mask
from trainers.losses.advantages import judge_pairs
from trainers.losses.rl import grpo_loss, online_dpo_loss, ppo_loss, rloo_loss

with warnings.catch_warnings():  # TRL warns, once, that its experimental trainers may change
    warnings.simplefilter("ignore", TRLExperimentalWarning)
    from trl.experimental.online_dpo import OnlineDPOTrainer


# -- GRPO: against TRL 1.16 ---------------------------------------------------------------------------------
class _Accelerator:
    num_processes = 1

    def reduce(self, t: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return t

    gather_for_metrics = gather


def trl_grpo_loss(
    logps: torch.Tensor,
    old: torch.Tensor,
    ref: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    beta: float,
    epsilon: float,
    epsilon_high: float,
    max_len: int,
) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """TRL's own `GRPOTrainer._compute_loss`, called on a stand-in `self` whose model forward returns our
    log-probs (token-level importance sampling, no vLLM, no entropy mask, one process, no accumulation)."""
    metrics: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        loss_type=loss_type,
        epsilon_low=epsilon,
        epsilon_high=epsilon_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=max_len,
        accelerator=_Accelerator(),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=metrics,
    )
    b, t = logps.shape
    inputs = {
        "prompt_ids": torch.zeros(b, 2, dtype=torch.long),
        "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.zeros(b, t, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    loss = GRPOTrainer._compute_loss(stub, None, inputs)  # type: ignore[arg-type,no-untyped-call]
    return loss, metrics["train"]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize(("beta", "epsilon_high"), [(0.0, 0.2), (0.04, 0.28)])
def test_grpo_loss_equals_trl(loss_type: str, beta: float, epsilon_high: float) -> None:
    torch.manual_seed(1)
    b, t = 6, 7
    logps = (torch.randn(b, t) - 2).requires_grad_()
    old = logps.detach() + 0.3 * torch.randn(b, t)  # ratios well outside the clip range
    ref = logps.detach() + 0.5 * torch.randn(b, t)
    adv = torch.randn(b)
    mask = (torch.arange(t) < torch.tensor([7, 5, 1, 3, 7, 2]).unsqueeze(1)).long()
    kw: dict[str, Any] = {"beta": beta, "epsilon": 0.2, "epsilon_high": epsilon_high}
    ours, metrics = grpo_loss(logps, old, ref, adv, mask, loss_type=loss_type, max_completion_length=10, **kw)
    theirs, trl_metrics = trl_grpo_loss(logps, old, ref, adv, mask, loss_type=loss_type, max_len=10, **kw)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)
    grad_ours = torch.autograd.grad(ours, logps)[0]
    grad_theirs = torch.autograd.grad(theirs, logps)[0]
    assert torch.allclose(grad_ours, grad_theirs, atol=1e-6)
    assert metrics["clip_ratio"] == pytest.approx(trl_metrics["clip_ratio/region_mean"][0], abs=1e-6)
    assert metrics["clip_ratio"] > 0
    if beta:
        assert metrics["kl"] == pytest.approx(trl_metrics["kl"][0], abs=1e-6)


# -- PPO: the paper's equations, written out ----------------------------------------------------------------
def test_clipped_policy_and_value_losses_equal_the_paper() -> None:
    torch.manual_seed(2)
    shape = (4, 5)
    logps = torch.randn(shape) - 2
    old = logps + 0.4 * torch.randn(shape)
    values, old_values, returns = torch.randn(shape), torch.randn(shape), torch.randn(shape)
    adv, mask = torch.randn(shape), completion_mask()
    eps, eps_v, vf_coef = 0.2, 0.3, 0.1
    loss, m = ppo_loss(
        logps,
        old,
        values,
        old_values,
        adv,
        returns,
        mask,
        cliprange=eps,
        cliprange_value=eps_v,
        vf_coef=vf_coef,
    )
    pol, val, kl, clipped, n = 0.0, 0.0, 0.0, 0, 0
    for b, length in enumerate(LENGTHS):
        for t in range(length):
            ratio = float(torch.exp(logps[b, t] - old[b, t]))
            a = float(adv[b, t])
            # PPO eq. 7: L^CLIP = min(r A, clip(r, 1 - ε, 1 + ε) A); the loss is its negative.
            surrogate = min(ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a)
            pol -= surrogate
            clipped += surrogate != ratio * a
            v, v_old, r = float(values[b, t]), float(old_values[b, t]), float(returns[b, t])
            v_clip = v_old + min(max(v - v_old, -eps_v), eps_v)
            val += 0.5 * max((v - r) ** 2, (v_clip - r) ** 2)
            kl += 0.5 * float(logps[b, t] - old[b, t]) ** 2
            n += 1
    assert loss.item() == pytest.approx((pol + vf_coef * val) / n, abs=1e-5)
    assert m["policy_loss"] == pytest.approx(pol / n, abs=1e-5)
    assert m["value_loss"] == pytest.approx(val / n, abs=1e-5)
    assert m["approx_kl"] == pytest.approx(kl / n, abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(clipped / n, abs=1e-6) and 0 < clipped < n


# -- RLOO: against TRL 1.16 ---------------------------------------------------------------------------------
def trl_rloo_loss(
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
    theirs, trl_metrics = trl_rloo_loss(logps, old, adv, mask, epsilon=0.2, epsilon_high=epsilon_high)
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


# -- online DPO: against TRL 1.16 ---------------------------------------------------------------------------
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


def test_doctests_pass() -> None:
    result = doctest.testmod(trainers.losses.rl)
    assert result.attempted >= 3 and result.failed == 0


# -- the edges: defaults, one token, a zero advantage, a ratio on the clip boundary ------------------------
def _spread(b: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    logps = torch.randn(b, t) - 2
    return logps, logps + 0.5 * torch.randn(b, t), torch.ones(b, t)


def test_the_default_clip_range_is_0_2() -> None:
    logps, old, mask = _spread(4, 5)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0])
    loss, metrics = grpo_loss(logps, old, None, adv, mask, max_completion_length=5)
    assert (loss, metrics) == grpo_loss(logps, old, None, adv, mask, epsilon=0.2, max_completion_length=5)
    assert metrics["clip_ratio"] > 0  # the ratios reach past 0.8 and 1.2
    assert "kl" not in metrics  # no KL term, no KL metric
    seq_old = (old * mask).sum(1)
    assert rloo_loss(logps, seq_old, adv, mask) == rloo_loss(logps, seq_old, adv, mask, epsilon=0.2)
    values, old_values, returns = torch.zeros(4, 5), logps, -logps  # value moves far past ±0.2
    ppo = ppo_loss(logps, old, values, old_values, adv.unsqueeze(1).expand(4, 5), returns, mask)
    explicit = ppo_loss(
        logps,
        old,
        values,
        old_values,
        adv.unsqueeze(1).expand(4, 5),
        returns,
        mask,
        cliprange=0.2,
        cliprange_value=0.2,
    )
    assert ppo == explicit


def test_a_batch_of_one_token_is_its_own_mean() -> None:
    logp, old = torch.tensor([[-1.0, 0.0]]), torch.tensor([[-1.5, 0.0]])  # ratio e^0.5, clipped at 1.2
    mask = torch.tensor([[1, 0]])
    for loss_type in ("grpo", "dapo"):
        loss, metrics = grpo_loss(
            logp, old, None, torch.tensor([2.0]), mask, loss_type=loss_type, max_completion_length=2
        )
        assert loss.item() == pytest.approx(-1.2 * 2.0) and metrics["clip_ratio"] == 1.0, loss_type
    # RLOO: one sequence of one token, its ratio e^0.5 clipped at 1.2
    loss, metrics = rloo_loss(logp, old.sum(1), torch.tensor([2.0]), mask)
    assert loss.item() == pytest.approx(-1.2 * 2.0) and metrics["clip_ratio"] == 1.0
    z = torch.zeros(1, 2)
    loss, m = ppo_loss(logp, old, z, z, torch.full((1, 2), 2.0), z, mask, vf_coef=0.0)
    assert loss.item() == pytest.approx(-1.2 * 2.0) and m["clip_fraction"] == 1.0
    assert m["approx_kl"] == pytest.approx(0.5 * 0.5**2)


def test_a_zero_advantage_or_a_ratio_on_the_boundary_is_not_clipped() -> None:
    # ratios e and 1/e, far outside [0.8, 1.2], but a zero advantage: nothing for the clip to bound
    logps, rollout = torch.tensor([[1.0], [-1.0]]), torch.zeros(2, 1)
    zero, mask = torch.zeros(2), torch.ones(2, 1)
    assert grpo_loss(logps, rollout, None, zero, mask, max_completion_length=1)[1]["clip_ratio"] == 0.0
    assert rloo_loss(logps, rollout.sum(1), zero, mask)[1]["clip_ratio"] == 0.0
    # ratio exactly 1 with ε = 0: on the boundary, which is inside the range
    adv = torch.tensor([1.0, -1.0])
    grpo = grpo_loss(rollout, rollout, None, adv, mask, epsilon=0.0, max_completion_length=1)
    assert grpo[1]["clip_ratio"] == 0.0
    assert rloo_loss(rollout, rollout.sum(1), adv, mask, epsilon=0.0)[1]["clip_ratio"] == 0.0
    # a positive advantage below 1 with a ratio below 1 - ε: the clip bounds gains only, so it does not bind
    low = rloo_loss(torch.tensor([[-1.0]]), torch.tensor([0.0]), torch.tensor([0.5]), torch.ones(1, 1))
    assert low[1]["clip_ratio"] == 0.0


def test_a_kl_penalty_needs_the_reference() -> None:
    logps, old, mask = _spread(2, 3)
    with pytest.raises(ValueError, match=r"^beta > 0 needs reference log-probs$"):
        grpo_loss(logps, old, None, torch.ones(2), mask, beta=0.1, max_completion_length=3)
    with pytest.raises(
        ValueError, match=r"^loss_type must be one of \('grpo', 'dr_grpo', 'dapo'\), not 'bnpo'$"
    ):
        grpo_loss(logps, old, None, torch.ones(2), mask, loss_type="bnpo", max_completion_length=3)
