"""Group Relative Policy Optimization (GRPO): sample G completions per prompt, score them with reward
functions, and push up the likelihood of those better than their group's mean (Shao et al. 2024,
DeepSeekMath, eq. 3), with a clipped ratio to the sampling policy and an optional KL to the reference:

    J(θ) = E_q E_{o_1..o_G ~ π_old(·|q)} [ 1/G Σ_i 1/|o_i| Σ_t min(ρ_it Â_i, clip(ρ_it, 1-ε, 1+ε_h) Â_i)
                                           - β D_KL(π_θ || π_ref) ],
    ρ_it = π_θ(o_it | q, o_i<t) / π_old(o_it | q, o_i<t)
    Â_i = (r_i - mean(r_1..r_G)) / std(r_1..r_G)

``loss_type`` picks the normalisation: ``grpo`` (the 1/|o_i| per-sequence mean above), ``dr_grpo``
(Liu et al. 2025: Σ over tokens / (B · max_completion_length), usually with ``scale_rewards="none"``),
``dapo`` (Yu et al. 2025, eq. 8: one mean over every token of the step; with ``epsilon_high`` for
clip-higher). Each optimizer step samples a fresh rollout for ``batch_size * gradient_accumulation_steps``
prompts on the shared loop (``trainers.loop``), reused for ``num_iterations`` steps.

    python -c "
    from trainers.grpo import GRPOConfig, train_grpo; from trainers.rewards import build_grader
    from trainers.rl import RewardSet; from trainers.tiny_model import build_tiny_model
    rows = [{'prompt': 'The capital of Peru is'}] * 16
    grader = build_grader({'type': 'string_check', 'name': 'e', 'operation': 'like',
                           'input': '{{sample.output_text}}', 'reference': 'e'})
    config = GRPOConfig(str(build_tiny_model('/tmp/tiny')), '/tmp/grpo-out', max_steps=10)
    print(train_grpo(config, rows, rewards=RewardSet.of([grader])))"
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import PreTrainedTokenizerBase

from trainers.callbacks import TrainingCallbacks, TrainResult
from trainers.config import RolloutConfig
from trainers.entry import Rows
from trainers.loop import LossSums, PreparedStep
from trainers.registry import choices
from trainers.rl import RewardSet, completion_metrics, train_on_rollouts
from trainers.rollout import (
    ReusedRollout,
    RLPrompt,
    RolloutBatch,
    completion_logps,
    generate_rollout,
    micro_batch_spans,
    reference_logps,
)

LOSS_TYPES = choices("grpo", "loss_type")
SCALE_REWARDS = choices("grpo", "scale_rewards")


@dataclass
class GRPOConfig(RolloutConfig):
    """Configuration of a GRPO run: the shared fields of ``trainers.config.RolloutConfig``, plus

    Method:
        num_generations: completions sampled per prompt (G); the advantage compares them.
        beta: KL coefficient to the reference (k3 estimator); 0 skips the reference entirely. The
            reference is the base model: the adapter disabled for LoRA, a frozen copy for full training.
        epsilon, epsilon_high: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
            (epsilon_high None: epsilon).
        loss_type: ``grpo`` | ``dr_grpo`` | ``dapo`` (see the module docstring).
        scale_rewards: divide advantages by the reward std of the ``group``, of the ``batch``, or not
            (``none``).
        num_iterations: optimizer steps per rollout (μ); > 1 keeps the rollout's log-probs as π_old.
        mask_truncated_completions: completions without EOS get no loss.

    Shared fields as GRPO reads them: ``batch_size`` counts prompts per micro-batch, each with
    ``num_generations`` completions; validation (``eval_steps``) scores the validation prompts' completions.
    """

    method: ClassVar[str] = "grpo"

    learning_rate: float = 1e-5
    num_generations: int = 4
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "grpo"
    scale_rewards: str = "group"
    num_iterations: int = 1
    mask_truncated_completions: bool = False

    @property
    def uses_reference(self) -> bool:
        return self.beta != 0.0


# -- pure functions -------------------------------------------------------------------------------------
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
        std = nanstd(rewards) if rewards.numel() > 1 else torch.zeros(())
        advantages = advantages / (std + 1e-4)
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
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, not {loss_type!r}")
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


# -- batches --------------------------------------------------------------------------------------------
@dataclass
class GRPOBatch(RolloutBatch):
    """One micro-batch of a rollout: [N, P] prompts, [N, C] completions, [N] advantages."""

    # completion_mask is the loss mask: zero for truncated completions if they are masked
    advantages: torch.Tensor
    old_logps: torch.Tensor | None  # π_old when num_iterations > 1; else the current policy, detached
    ref_logps: torch.Tensor | None  # when beta > 0
    loss_units: int  # this micro-batch's share of the step's loss denominator
    metric_scale: float  # step loss units / step completion tokens: token sums / units = token means

    @property
    def loss_denominator(self) -> int:
        return self.loss_units


def grpo_batch_loss(model: torch.nn.Module, batch: GRPOBatch, *, config: GRPOConfig) -> LossSums:
    """Summed GRPO loss of a micro-batch, with entropy, kl and clip_ratio sums scaled to token means."""
    logps, entropy = completion_logps(
        model,
        batch.prompt_ids,
        batch.prompt_mask,
        batch.completion_ids,
        batch.completion_mask,
        temperature=config.temperature,
    )
    old = batch.old_logps if batch.old_logps is not None else logps.detach()
    terms = grpo_loss_terms(
        logps,
        old,
        batch.ref_logps,
        batch.advantages,
        batch.completion_mask,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high,
        beta=config.beta,
        loss_type=config.loss_type,
        max_completion_length=config.max_completion_length,
    )
    scale = batch.metric_scale
    metrics = {
        "clip_ratio": float(terms.clip_sum) * scale,
        "entropy": float((entropy * batch.completion_mask).sum()) * scale,
    }
    if config.beta != 0.0:
        metrics["kl"] = float(terms.kl_sum) * scale
    return LossSums(loss=terms.loss_sum, metrics=metrics)


# -- rollouts -------------------------------------------------------------------------------------------
class GRPORollouts(ReusedRollout[GRPOBatch]):
    """The loop's ``StepPreparer`` for GRPO: sample, score, compute advantages, split into micro-batches."""

    def __init__(
        self,
        config: GRPOConfig,
        tokenizer: PreTrainedTokenizerBase,
        rewards: RewardSet,
        reference: torch.nn.Module | None,
    ) -> None:
        super().__init__(GRPOBatch, config.num_iterations)
        self.config, self.tokenizer, self.rewards, self.reference = config, tokenizer, rewards, reference

    def rollout(self, model: torch.nn.Module, examples: list[Sequence[RLPrompt]]) -> PreparedStep[GRPOBatch]:
        c = self.config
        seed = int(torch.randint(0, 2**62, (1,)).item())  # from the loop's RNG: resumes draw the same
        rollout = generate_rollout(
            model,
            self.tokenizer,
            [p for group in examples for p in group],
            num_generations=c.num_generations,
            max_completion_length=c.max_completion_length,
            temperature=c.temperature,
            top_p=c.top_p,
            seed=seed,
        )
        scores = self.rewards.score(rollout.prompts, rollout.completions, rollout.columns)
        advantages = group_advantages(scores.total, c.num_generations, c.scale_rewards)
        device = rollout.completion_ids.device
        loss_mask = rollout.loss_mask(c.mask_truncated_completions)
        spans = micro_batch_spans([len(group) * c.num_generations for group in examples])
        units = [self._units(loss_mask[rows]) for rows in spans]
        metric_scale = max(1, sum(units)) / max(1, int(loss_mask.sum()))
        batches = []
        for rows, n_units in zip(spans, units, strict=True):
            part = rollout.select(rows)
            old = None
            if c.num_iterations > 1:
                with torch.no_grad():
                    old = completion_logps(model, *part.inputs, temperature=c.temperature)[0]
            ref = None
            if c.beta != 0.0:
                ref = reference_logps(model, self.reference, *part.inputs, temperature=c.temperature)
            batches.append(
                GRPOBatch(
                    prompt_ids=part.prompt_ids,
                    prompt_mask=part.prompt_mask,
                    completion_ids=part.completion_ids,
                    completion_mask=loss_mask[rows, : part.width],
                    advantages=advantages[rows].to(device),
                    old_logps=old,
                    ref_logps=ref,
                    loss_units=n_units,
                    metric_scale=metric_scale,
                )
            )
        metrics = {
            **group_reward_metrics(scores.total, c.num_generations),
            **completion_metrics(rollout.completion_mask, rollout.truncated),
            **scores.metrics(),
        }
        return PreparedStep(batches, metrics)

    def _units(self, mask: torch.Tensor) -> int:
        if self.config.loss_type == "grpo":
            return int(mask.size(0))
        if self.config.loss_type == "dr_grpo":
            return int(mask.size(0)) * self.config.max_completion_length
        return int(mask.sum())


# -- entry point ----------------------------------------------------------------------------------------
def train_grpo(
    config: GRPOConfig,
    train_rows: Rows,
    valid_rows: Rows | None = None,
    callbacks: TrainingCallbacks | None = None,
    *,
    rewards: RewardSet | None = None,
) -> TrainResult:
    """Train ``config.model_path`` with GRPO on the prompts of ``train_rows``, rewarded by ``rewards``."""
    return train_on_rollouts(
        config, train_rows, valid_rows, callbacks, rewards, GRPORollouts, grpo_batch_loss
    )
