"""The objectives of the online RL methods, per batch of sampled completions. Pure functions on tensors.

Each ``*_loss_terms`` returns *sums* over a batch, so that the shared loop (``trainers.core.loop``) can
normalise a whole accumulated step by one denominator however it is split into micro-batches; each
``*_loss`` is the same for one batch, normalised, with its metrics (what the tests compare with TRL).
The advantages they weight come from ``trainers.losses.advantages``.

- GRPO: the clipped surrogate per token with a k3 KL to the reference, normalised by ``loss_type``;
- PPO: the clipped policy and value losses per token;
- RLOO: the clipped REINFORCE surrogate on whole sequences;
- online DPO: ``trainers.losses.preference.dpo_loss`` on the judged pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainers.losses.advantages import JudgedPairs
from trainers.losses.preference import dpo_loss
from trainers.registry import choices

GRPO_LOSS_TYPES = choices("grpo", "loss_type")
ONLINE_DPO_LOSS_TYPES = choices("online_dpo", "loss_type")


# -- GRPO ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GRPOLossTerms:
    """Sums over a batch; ``loss = loss_sum / denominator``. Token sums are over masked tokens."""

    loss_sum: torch.Tensor  # scalar, differentiable
    denominator: torch.Tensor  # scalar: sequences (grpo), B * max_completion_length (dr_grpo), tokens (dapo)
    n_tokens: torch.Tensor  # masked completion tokens
    kl_sum: torch.Tensor  # Σ per-token k3 KL (0 when beta == 0)
    clip_sum: torch.Tensor  # tokens whose ratio was clipped in the direction of the advantage


def grpo_loss_terms(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float,
    epsilon_high: float | None,
    beta: float,
    loss_type: str,
    max_completion_length: int,
) -> GRPOLossTerms:
    """The clipped surrogate with a KL penalty, per token, then summed as ``loss_type`` says.

    logps, old_logps, ref_logps, mask: [B, T]; advantages: [B]. Per token (DeepSeekMath eq. 3, 4):

        l_t = -min(ρ_t Â, clip(ρ_t, 1 - ε, 1 + ε_high) Â) + β (exp(ref - logp) - (ref - logp) - 1)

    with ρ_t = exp(logp_t - old_logp_t) and the k3 KL estimator (Schulman 2020).
    """
    mask = mask.to(logps.dtype)
    high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = torch.zeros_like(logps)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs reference log-probs")
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
    masked = per_token * mask
    n_tokens = mask.sum()
    if loss_type == "grpo":
        loss_sum = (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).sum()
        denominator = torch.tensor(float(logps.size(0)))
    elif loss_type == "dr_grpo":
        loss_sum = masked.sum()
        denominator = torch.tensor(float(logps.size(0) * max_completion_length))
    elif loss_type == "dapo":
        loss_sum = masked.sum()
        denominator = n_tokens.clamp(min=1.0)
    else:
        raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, not {loss_type!r}")
    is_clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
    return GRPOLossTerms(
        loss_sum=loss_sum,
        denominator=denominator,
        n_tokens=n_tokens.detach(),
        kl_sum=(kl * mask).sum().detach(),
        clip_sum=(is_clipped.to(mask.dtype) * mask).sum(),
    )


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    loss_type: str = "grpo",
    max_completion_length: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO loss of one batch (shapes as ``grpo_loss_terms``) and its metrics ``kl``, ``clip_ratio``
    (token means).

    ``grpo``: mean over sequences of each sequence's token mean; ``dr_grpo``: token sum over
    (B * max_completion_length); ``dapo``: mean over all tokens.

    >>> lp, mask, adv = torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([1.0, -1.0])
    >>> loss, m = grpo_loss(lp, lp, None, adv, mask, max_completion_length=3)
    >>> float(loss), m["clip_ratio"]
    (0.0, 0.0)
    """
    terms = grpo_loss_terms(
        logps,
        old_logps,
        ref_logps,
        advantages,
        mask,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        beta=beta,
        loss_type=loss_type,
        max_completion_length=max_completion_length,
    )
    tokens = float(terms.n_tokens.clamp(min=1.0))
    metrics = {"clip_ratio": float(terms.clip_sum) / tokens}
    if beta != 0.0:
        metrics["kl"] = float(terms.kl_sum) / tokens
    return terms.loss_sum / terms.denominator, metrics


# -- PPO ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PPOLossTerms:
    """Sums over the masked tokens of a batch."""

    loss_sum: torch.Tensor  # policy + vf_coef * value, differentiable
    policy_sum: torch.Tensor
    value_sum: torch.Tensor
    approx_kl_sum: torch.Tensor  # Σ ½ (log ρ)²
    clip_sum: torch.Tensor  # tokens where the clipped policy term was the larger
    n_tokens: torch.Tensor


def ppo_loss_terms(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    values: torch.Tensor,
    old_values: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    cliprange: float,
    cliprange_value: float,
    vf_coef: float,
) -> PPOLossTerms:
    """Clipped policy loss (PPO eq. 7) and clipped value loss (as in OpenAI baselines' PPO2), per token.

    All inputs [B, T]. With ρ = exp(logp - old_logp):

        policy_t = max(-Â_t ρ_t, -Â_t clip(ρ_t, 1 - ε, 1 + ε))
        value_t  = ½ max((V_t - R_t)², (V_old,t + clip(V_t - V_old,t, -ε_v, ε_v) - R_t)²)
    """
    mask = mask.to(logps.dtype)
    log_ratio = logps - old_logps
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    policy = torch.max(unclipped, clipped)
    values_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    value = 0.5 * torch.max((values - returns) ** 2, (values_clipped - returns) ** 2)
    policy_sum, value_sum = (policy * mask).sum(), (value * mask).sum()
    return PPOLossTerms(
        loss_sum=policy_sum + vf_coef * value_sum,
        policy_sum=policy_sum.detach(),
        value_sum=value_sum.detach(),
        approx_kl_sum=(0.5 * log_ratio.detach() ** 2 * mask).sum(),
        clip_sum=((clipped > unclipped).to(mask.dtype) * mask).sum(),
        n_tokens=mask.sum(),
    )


def ppo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    values: torch.Tensor,
    old_values: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    cliprange: float = 0.2,
    cliprange_value: float = 0.2,
    vf_coef: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean PPO loss ``policy + vf_coef * value`` and its metrics (shapes as ``ppo_loss_terms``).

    >>> z, one = torch.zeros(1, 2), torch.ones(1, 2)
    >>> loss, m = ppo_loss(z, z, z, z, one, one, one)
    >>> round(float(loss), 4), m["policy_loss"], m["value_loss"]
    (-0.95, -1.0, 0.5)
    """
    t = ppo_loss_terms(
        logps,
        old_logps,
        values,
        old_values,
        advantages,
        returns,
        mask,
        cliprange=cliprange,
        cliprange_value=cliprange_value,
        vf_coef=vf_coef,
    )
    n = t.n_tokens.clamp(min=1.0)
    metrics = {
        "policy_loss": float(t.policy_sum / n),
        "value_loss": float(t.value_sum / n),
        "approx_kl": float(t.approx_kl_sum / n),
        "clip_fraction": float(t.clip_sum / n),
    }
    return t.loss_sum / n, metrics


# -- RLOO ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RLOOLossTerms:
    """Sums over a batch's sequences; ``loss = loss_sum / n_sequences``."""

    loss_sum: torch.Tensor  # scalar, differentiable
    clip_sum: torch.Tensor  # sequences whose ratio was clipped in the direction of the advantage


def rloo_loss_terms(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float,
    epsilon_high: float | None,
) -> RLOOLossTerms:
    """The clipped REINFORCE surrogate on whole sequences, summed over the batch.

    logps, mask: [N, T] per-token log-probs under π_θ and the completion mask; old_logps: [N] summed
    log-probs under the sampling policy; advantages: [N]. With ρ = exp(Σ_t logp_t - old_logp):

        l = -min(ρ A, clip(ρ, 1 - ε, 1 + ε_high) A)

    whose gradient at ρ = 1 is -A ∇ log π_θ(y | x), the leave-one-out REINFORCE estimator.
    """
    high = epsilon if epsilon_high is None else epsilon_high
    seq_logps = (logps * mask.to(logps.dtype)).sum(dim=1)
    ratio = torch.exp(seq_logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
    per_sequence = -torch.min(ratio * advantages, clipped * advantages)
    is_clipped = ((ratio < 1 - epsilon) & (advantages < 0)) | ((ratio > 1 + high) & (advantages > 0))
    return RLOOLossTerms(loss_sum=per_sequence.sum(), clip_sum=is_clipped.sum().detach().to(logps.dtype))


def rloo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """RLOO loss of one batch, the mean over its sequences (shapes as ``rloo_loss_terms``), and its
    ``clip_ratio`` (the fraction of sequences clipped).

    >>> lp, mask = torch.zeros(2, 3), torch.ones(2, 3)
    >>> loss, m = rloo_loss(lp, lp.sum(1), torch.tensor([1.0, -1.0]), mask)
    >>> float(loss), m["clip_ratio"]
    (0.0, 0.0)
    """
    terms = rloo_loss_terms(logps, old_logps, advantages, mask, epsilon=epsilon, epsilon_high=epsilon_high)
    n = max(1, logps.size(0))
    return terms.loss_sum / n, {"clip_ratio": float(terms.clip_sum) / n}


# -- online DPO ---------------------------------------------------------------------------------------------
def online_dpo_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    pairs: JudgedPairs,
    *,
    beta: float,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO losses of the judged pairs, and their implicit rewards.

    logps, ref_logps: [2B] summed completion log-probs log π(y|x) under the policy and the reference;
    ``pairs`` from ``judge_pairs``. Returns (losses, chosen_rewards, rejected_rewards), each [B], with
    ``trainers.losses.preference.dpo_loss`` on (y_w, y_l) (``sigmoid``: -log σ(β h); ``ipo``: (h - 1/(2β))²,
    h the
    difference of log-ratios, unnormalised); an unjudged pair's loss is 0.
    """
    if loss_type not in ONLINE_DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {ONLINE_DPO_LOSS_TYPES}, not {loss_type!r}")
    losses, chosen_rewards, rejected_rewards = dpo_loss(
        logps[pairs.chosen],
        logps[pairs.rejected],
        ref_logps[pairs.chosen],
        ref_logps[pairs.rejected],
        beta=beta,
        loss_type=loss_type,
    )
    return losses * pairs.judged.to(losses.dtype), chosen_rewards, rejected_rewards
