"""The learning signal of the online RL methods: how scores become advantages. Pure functions on tensors.

Each method samples completions, scores them (``trainers.families.rl``), and turns the scores into advantages
here; ``trainers.losses.rl`` then weights the policy's log-probs by them.

- GRPO: ``group_advantages``, each completion against its group's mean (and std);
- PPO: ``per_token_rewards`` (score at the last real token, KL penalty at every token), ``gae`` and
  ``masked_whiten``;
- RLOO: ``rloo_advantages``, each completion against the mean of its siblings, with ``sequence_kl``;
- online DPO: ``judge_pairs``, the judge's verdict on each sampled pair.

Kept apart from the methods' rollout and training code so that their tests are fast enough to run on
every change, and under the mutation check (``make mutants MODULES=trainers/losses/advantages.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainers.registry import choices

SCALE_REWARDS = choices("grpo", "scale_rewards")


# -- GRPO ---------------------------------------------------------------------------------------------------
def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Standard deviation with Bessel's correction, ignoring NaNs (NaN with fewer than 2 values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, math.nan))
    std = variance.sqrt()
    return std.squeeze(dim) if dim is not None else std.reshape(())


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: str = "group") -> torch.Tensor:
    """Group-relative advantages (DeepSeekMath, §4.1.2 "outcome supervision"): Â_i = (r_i - mean_g r) / σ.

    rewards: [B * G], each prompt's G rewards adjacent; NaN for a completion no reward function scored.
    scale: σ is the std of the group (``group``), of all B * G rewards (``batch``), or 1 (``none``, Dr. GRPO).
    Returns [B * G]; NaN rewards get advantage 0. σ gets + 1e-4, as in TRL, so uniform groups give 0.

    >>> group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, "none")
    tensor([ 0.5000, -0.5000,  0.0000,  0.0000])
    """
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale == "group":
        advantages = advantages / (nanstd(grouped, dim=1).repeat_interleave(num_generations) + 1e-4)
    elif scale == "batch":
        # a single reward has no std (NaN), but then its advantage is 0 - 0, which nan_to_num keeps 0
        advantages = advantages / (nanstd(rewards) + 1e-4)
    elif scale != "none":
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, not {scale!r}")
    return torch.nan_to_num(advantages, nan=0.0)


def group_reward_metrics(rewards: torch.Tensor, num_generations: int) -> dict[str, float]:
    """``reward`` (mean), ``reward_std`` (the mean within-group std) and ``frac_reward_zero_std`` (groups
    whose completions all scored the same: no learning signal) of [B * G] rewards, NaN ignored."""
    group_std = nanstd(rewards.view(-1, num_generations), dim=1)
    return {
        "reward": float(torch.nanmean(rewards)),
        "reward_std": float(torch.nanmean(group_std)),
        "frac_reward_zero_std": float(torch.isclose(group_std, torch.zeros_like(group_std)).float().mean()),
    }


# -- PPO ----------------------------------------------------------------------------------------------------
def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16) and returns.

    rewards, values, mask: [B, T]; ``mask`` is a prefix of each row (the completion). The episode ends
    after the last masked token, so V = 0 there:

        δ_t = r_t + γ V_{t+1} - V_t,    Â_t = Σ_{l ≥ 0} (γλ)^l δ_{t+l},    R_t = Â_t + V_t

    Returns (advantages, returns), [B, T], zero outside the mask.

    >>> rewards, values = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.5]])
    >>> adv, ret = gae(rewards, values, torch.ones(1, 2), gamma=1, lam=1)
    >>> adv.tolist(), ret.tolist()
    ([[0.5, 0.5]], [[1.0, 1.0]])
    """
    mask = mask.to(values.dtype)
    rewards, values = rewards * mask, values * mask
    steps = rewards.size(1)
    last = torch.zeros_like(rewards[:, 0])
    reversed_advantages = []
    for t in reversed(range(steps)):
        next_value = values[:, t + 1] if t + 1 < steps else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        reversed_advantages.append(last)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    return advantages * mask, (advantages + values) * mask


def per_token_rewards(
    scores: torch.Tensor,
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards of a rollout (Ouyang et al. 2022, eq. 2; Ziegler et al. 2019) and the KL.

    scores: [B], one per completion; logps, ref_logps, mask: [B, T], ``mask`` a prefix of each row (the
    completion, EOS included). The score is paid at the last real token, the KL penalty at every token:

        kl_t = log π_old(o_t) - log π_ref(o_t),    r_t = -kl_coef · kl_t + [t = last] · score

    Returns (rewards, kl), [B, T], zero outside the mask (an empty completion gets its score at t = 0).

    >>> lp, ref = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.5, -1.0, -0.3]])
    >>> per_token_rewards(torch.tensor([3.0]), lp, ref, torch.ones(1, 3), kl_coef=0.1)[0]
    tensor([[-0.0500,  0.1000,  3.0200]])
    """
    mask = mask.to(logps.dtype)
    kl = (logps - ref_logps) * mask
    rewards = -kl_coef * kl
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(last)), last] += scores.to(rewards.dtype)
    return rewards, kl


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-8,
    *,
    across: Callable[[torch.Tensor], torch.Tensor] = lambda total: total,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (unbiased variance); 0 outside the mask.
    ``across`` turns a sum over this ``x`` into the sum over the whole batch, when other processes hold
    the rest of it (``trainers.core.distributed.sum_tensor``); by default ``x`` is the whole batch.

    >>> masked_whiten(torch.tensor([[1.0, 3.0, 9.0]]), torch.tensor([[1, 1, 0]]))
    tensor([[-0.7071,  0.7071,  0.0000]])
    """
    mask = mask.to(x.dtype)
    n = across(mask.sum())
    if n == 0:  # nothing to whiten (e.g. no completion of the rollout was scored)
        return torch.zeros_like(x)
    mean = across((x * mask).sum()) / n
    var = across((((x - mean) ** 2) * mask).sum()) / n
    if n > 1:
        var = var * n / (n - 1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


# -- RLOO ---------------------------------------------------------------------------------------------------
def sequence_kl(old_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(y) = Σ_t (log π_old(y_t) - log π_ref(y_t)) over each completion's tokens: the paper's
    first-order estimate (Ahmadian et al. 2024, §3), which can be negative per token, unlike GRPO's k3.

    old_logps, ref_logps, mask: [N, T]. Returns [N].

    >>> sequence_kl(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2))
    tensor([-0.5000])
    """
    return ((old_logps - ref_logps) * mask.to(old_logps.dtype)).sum(dim=1)


def rloo_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
    normalize: bool = False,
) -> torch.Tensor:
    """Leave-one-out advantages (Ahmadian et al. 2024, eq. 6) of the KL-penalised rewards:

        R_i = r_i - β KL_i,    A_i = R_i - 1/(k-1) Σ_{j≠i} R_j

    rewards: [B * k], each prompt's k rewards adjacent; NaN for a completion no reward function scored.
    kl: [B * k] (``sequence_kl``), needed when β > 0. The baseline averages the scored siblings only; a
    NaN reward, or one whose group has no other scored completion, gets advantage 0. ``normalize``: then
    (A - mean A) / (std A + 1e-4) over the batch's scored completions, as TRL's ``normalize_advantages``.
    Returns [B * k].

    >>> rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 3.0, 3.0, float("nan")]), 3)
    tensor([ 1.0000, -0.5000, -0.5000,  0.0000,  0.0000,  0.0000])
    """
    if beta != 0.0:
        if kl is None:
            raise ValueError("beta > 0 needs the completions' KL to the reference")
        rewards = rewards - beta * kl
    grouped = rewards.view(-1, num_generations)
    scored = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    others = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scored - 1)
    advantages = rewards - others.view(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


# -- online DPO ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class JudgedPairs:
    """Indices into the 2B completions of B prompts (each prompt's two adjacent), each [B]."""

    chosen: torch.Tensor  # long
    rejected: torch.Tensor  # long
    judged: torch.Tensor  # bool: the scores order the pair (both scored, not equal)


def judge_pairs(scores: torch.Tensor) -> JudgedPairs:
    """The judge's verdict on each pair: the higher score is chosen (Guo et al. 2024, Alg. 1, step 3).

    scores: [2B], completions 2i and 2i + 1 answer prompt i; NaN where no grader scored a completion.

    >>> p = judge_pairs(torch.tensor([0.0, 1.0, 2.0, 1.0, 1.0, 1.0]))
    >>> p.chosen.tolist(), p.rejected.tolist(), p.judged.tolist()
    ([1, 2, 4], [0, 3, 5], [True, True, False])
    """
    pairs = scores.view(-1, 2)
    second_wins = (pairs[:, 1] > pairs[:, 0]).long()
    first = torch.arange(pairs.size(0), device=scores.device) * 2
    judged = ~torch.isnan(pairs).any(dim=1) & (pairs[:, 0] != pairs[:, 1])
    return JudgedPairs(chosen=first + second_wins, rejected=first + 1 - second_wins, judged=judged)
