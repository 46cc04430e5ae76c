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
    from trainers.tiny_model import build_tiny_model
    rows = [{'prompt': 'The capital of Peru is'}] * 16
    grader = build_grader({'type': 'string_check', 'name': 'e', 'operation': 'like',
                           'input': '{{sample.output_text}}', 'reference': 'e'})
    config = GRPOConfig(str(build_tiny_model('/tmp/tiny')), '/tmp/grpo-out', max_steps=10)
    print(train_grpo(config, rows, [grader]))"
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any, Self

import torch
from transformers import PreTrainedTokenizerBase

from trainers.callbacks import TrainingCallbacks, TrainResult
from trainers.config import TrainingConfig
from trainers.errors import DataError
from trainers.loop import LossSums, PreparedStep, TrainingTask, run_training
from trainers.modeling import load_model, load_tokenizer, pick_device
from trainers.rewards import RewardFunc, reward_name
from trainers.rng import seed_everything
from trainers.rollout import (
    RLPrompt,
    Rollout,
    completion_logps,
    generate_rollout,
    load_frozen_reference,
    reference_logps,
    tokenize_rl_rows,
    trim_left_padding,
)

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class GRPOConfig(TrainingConfig):
    """Configuration of a GRPO run: the shared fields of ``trainers.config.TrainingConfig``, plus

    Data:
        max_prompt_length: prompts keep their last this many tokens.

    Method:
        num_generations: completions sampled per prompt (G); the advantage compares them.
        max_completion_length: sampling budget in tokens; a completion without EOS is truncated.
        temperature, top_p: sampling parameters; log-probs are computed at the same temperature.
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
    ``num_generations`` completions; ``eval_steps`` is unused (GRPO has no validation loss yet).
    """

    learning_rate: float = 1e-5
    max_prompt_length: int = 512
    num_generations: int = 4
    max_completion_length: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "grpo"
    scale_rewards: str = "group"
    num_iterations: int = 1
    mask_truncated_completions: bool = False

    def _data_checks(self) -> dict[str, bool]:
        return {"max_prompt_length": self.max_prompt_length >= 1}

    def _method_checks(self) -> dict[str, bool]:
        return {
            "num_generations": self.num_generations >= 2,
            "max_completion_length": self.max_completion_length >= 1,
            "temperature": self.temperature > 0,
            "top_p": 0.0 < self.top_p <= 1.0,
            "beta": self.beta >= 0,
            "epsilon": self.epsilon >= 0,
            "epsilon_high": self.epsilon_high is None or self.epsilon_high >= 0,
            "loss_type": self.loss_type in LOSS_TYPES,
            "scale_rewards": self.scale_rewards in SCALE_REWARDS,
            "num_iterations": self.num_iterations >= 1,
        }


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
class GRPOBatch:
    """One micro-batch of a rollout: [N, P] prompts, [N, C] completions, [N] advantages."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor  # loss mask: zero for truncated completions if they are masked
    advantages: torch.Tensor
    old_logps: torch.Tensor | None  # π_old when num_iterations > 1; else the current policy, detached
    ref_logps: torch.Tensor | None  # when beta > 0
    loss_units: int  # this micro-batch's share of the step's loss denominator
    metric_scale: float  # step loss units / step completion tokens: token sums / units = token means

    @property
    def loss_denominator(self) -> int:
        return self.loss_units

    @property
    def n_tokens(self) -> int:
        return int(self.prompt_mask.sum()) + int(self.completion_mask.sum())

    def to(self, device: torch.device) -> Self:
        moved: dict[str, Any] = {
            f.name: v.to(device) for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def state_dict(self) -> dict[str, Any]:
        return {
            f.name: v.cpu() if isinstance(v := getattr(self, f.name), torch.Tensor) else v
            for f in fields(self)
        }


def _no_collate(examples: Sequence[RLPrompt]) -> GRPOBatch:
    raise TypeError("GRPO batches are built from rollouts by GRPORollouts, not collated")


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
class GRPORollouts:
    """The loop's ``StepPreparer`` for GRPO: sample, score, compute advantages, split into micro-batches."""

    def __init__(
        self,
        config: GRPOConfig,
        tokenizer: PreTrainedTokenizerBase,
        reward_funcs: Sequence[RewardFunc],
        reward_weights: Sequence[float],
        reward_names: Sequence[str],
        reference: torch.nn.Module | None,
    ) -> None:
        self.config, self.tokenizer, self.reference = config, tokenizer, reference
        self.reward_funcs, self.reward_weights, self.reward_names = (
            list(reward_funcs),
            list(reward_weights),
            list(reward_names),
        )
        self.steps_per_rollout = config.num_iterations
        self.current: PreparedStep[GRPOBatch] | None = None

    def prepare(
        self, model: torch.nn.Module, examples: list[Sequence[RLPrompt]], repeat: int
    ) -> PreparedStep[GRPOBatch]:
        if repeat > 0 and self.current is not None:
            return self.current
        c = self.config
        seed = int(torch.randint(0, 2**62, (1,)).item())  # from the loop's RNG: resumes draw the same
        flat = [p for group in examples for p in group]
        rollout = generate_rollout(
            model,
            self.tokenizer,
            flat,
            num_generations=c.num_generations,
            max_completion_length=c.max_completion_length,
            temperature=c.temperature,
            top_p=c.top_p,
            seed=seed,
        )
        per_func = self._score(rollout)  # [N, F]
        weights = torch.tensor(self.reward_weights, dtype=torch.float32)
        rewards = (per_func * weights).nansum(dim=1)
        rewards[torch.isnan(per_func).all(dim=1)] = math.nan
        advantages = group_advantages(rewards, c.num_generations, c.scale_rewards)
        device = rollout.completion_ids.device
        loss_mask = rollout.completion_mask
        if c.mask_truncated_completions:
            loss_mask = loss_mask * (~rollout.truncated).long().unsqueeze(1)
        step_tokens = max(1, int(loss_mask.sum()))
        sizes = [len(group) * c.num_generations for group in examples]
        units = [self._units(loss_mask[s : s + n]) for s, n in zip(_starts(sizes), sizes, strict=True)]
        metric_scale = max(1, sum(units)) / step_tokens
        batches = []
        for start, size, n_units in zip(_starts(sizes), sizes, units, strict=True):
            rows = slice(start, start + size)
            prompt_ids, prompt_mask = trim_left_padding(rollout.prompt_ids[rows], rollout.prompt_mask[rows])
            width = max(1, int(rollout.completion_mask[rows].sum(dim=1).max()))
            completion_ids = rollout.completion_ids[rows, :width]
            completion_mask = loss_mask[rows, :width]
            args = (prompt_ids, prompt_mask, completion_ids, rollout.completion_mask[rows, :width])
            old = None
            if c.num_iterations > 1:
                with torch.no_grad():
                    old = completion_logps(model, *args, temperature=c.temperature)[0]
            ref = None
            if c.beta != 0.0:
                ref = reference_logps(model, self.reference, *args, temperature=c.temperature)
            batches.append(
                GRPOBatch(
                    prompt_ids=prompt_ids,
                    prompt_mask=prompt_mask,
                    completion_ids=completion_ids,
                    completion_mask=completion_mask,
                    advantages=advantages[rows].to(device),
                    old_logps=old,
                    ref_logps=ref,
                    loss_units=n_units,
                    metric_scale=metric_scale,
                )
            )
        self.current = PreparedStep(batches, self._metrics(rollout, per_func, rewards))
        return self.current

    def _units(self, mask: torch.Tensor) -> int:
        if self.config.loss_type == "grpo":
            return int(mask.size(0))
        if self.config.loss_type == "dr_grpo":
            return int(mask.size(0)) * self.config.max_completion_length
        return int(mask.sum())

    def _score(self, rollout: Rollout) -> torch.Tensor:
        columns = []
        for func, name in zip(self.reward_funcs, self.reward_names, strict=True):
            scores = func(list(rollout.prompts), list(rollout.completions), **rollout.columns)
            if len(scores) != len(rollout.completions):
                raise ValueError(f"reward {name!r} returned {len(scores)} scores for {len(rollout.prompts)}")
            columns.append([math.nan if s is None else float(s) for s in scores])
        return torch.tensor(columns, dtype=torch.float32).T

    def _metrics(self, rollout: Rollout, per_func: torch.Tensor, rewards: torch.Tensor) -> dict[str, float]:
        g = self.config.num_generations
        group_std = nanstd(rewards.view(-1, g), dim=1)
        lengths = rollout.completion_lengths.float()
        metrics = {
            "reward": float(torch.nanmean(rewards)),
            "reward_std": float(torch.nanmean(group_std)),
            "frac_reward_zero_std": float(
                torch.isclose(group_std, torch.zeros_like(group_std)).float().mean()
            ),
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(rollout.truncated.float().mean()),
        }
        for i, name in enumerate(self.reward_names):
            metrics[f"rewards/{name}/mean"] = float(torch.nanmean(per_func[:, i]))
        return metrics

    def state_dict(self) -> dict[str, Any]:
        if self.current is None:
            return {}
        return {"batches": [b.state_dict() for b in self.current.batches], "metrics": self.current.metrics}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            batches: list[dict[str, Any]] = state["batches"]
            self.current = PreparedStep([GRPOBatch(**b) for b in batches], dict(state["metrics"]))


def _starts(sizes: Sequence[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


# -- entry point ----------------------------------------------------------------------------------------
def train_grpo(
    config: GRPOConfig,
    train_rows: Sequence[Mapping[str, Any]],
    reward_funcs: Sequence[RewardFunc],
    callbacks: TrainingCallbacks | None = None,
    *,
    reward_weights: Sequence[float] | None = None,
    reward_names: Sequence[str] | None = None,
) -> TrainResult:
    """Train ``config.model_path`` with GRPO on the prompts of ``train_rows``.

    ``reward_weights`` (default all 1) weight the reward functions' sum; ``reward_names`` name them in
    the metrics (default: a grader's name or the function's ``__name__``).
    """
    config.validate()
    if not reward_funcs:
        raise DataError("GRPO needs at least one reward function", param="grader")
    weights = list(reward_weights) if reward_weights is not None else [1.0] * len(reward_funcs)
    names = (
        list(reward_names)
        if reward_names is not None
        else [reward_name(f, i) for i, f in enumerate(reward_funcs)]
    )
    if len(weights) != len(reward_funcs) or len(names) != len(reward_funcs):
        raise ValueError("reward_weights and reward_names need one entry per reward function")
    seed_everything(config.seed)
    tokenizer = load_tokenizer(config.model_path)
    prompts = tokenize_rl_rows(train_rows, tokenizer, max_prompt_length=config.max_prompt_length)
    device = pick_device()
    model = load_model(config, device)
    reference = None
    if config.beta != 0.0 and not config.use_lora:
        reference = load_frozen_reference(config.model_path, device)
    preparer = GRPORollouts(config, tokenizer, reward_funcs, weights, names, reference)
    task = TrainingTask(
        model,
        tokenizer,
        prompts,
        _no_collate,
        partial(grpo_batch_loss, config=config),
        preparer=preparer,
    )
    return run_training(config, task, callbacks)
