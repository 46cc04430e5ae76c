"""The group-rollout family (GRPO, RLOO): each step samples ``num_generations`` completions per prompt, scores
them, turns each group's rewards into advantages with a *named* estimator, and splits the rollout into
micro-batches that a method's policy loss trains on for ``num_iterations`` steps.

The methods differ only in two named choices, registered here as verl registers its advantage estimators
(``verl/trainer/ppo/core_algos.py``, ``@register_adv_est``):
- the advantage estimator (``ADVANTAGE_ESTIMATORS``): ``grpo``, the group-normalised reward (Shao et al.
  2024, eq. 3); ``rloo``, the leave-one-out baseline (Ahmadian et al. 2024, eq. 6), which also takes the KL to
  the reference into the reward (``kl_in_reward``) instead of into each token's loss;
- the loss normalisation (``LOSS_UNITS``): what a step's summed loss is divided by (``grpo``: completions,
  ``dr_grpo``: completions x max_completion_length, ``dapo``: completion tokens).

A method is then its config, its policy loss on a ``GRPOBatch`` and a preparer naming both choices,
``GroupRollouts(config, tokenizer, rewards, reference, advantage="rloo", loss_units="grpo")``, handed to
``trainers.families.rl.train_on_rollouts``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerBase

from trainers.core import distributed as dist
from trainers.core.loop import PreparedStep
from trainers.families.rl import step_completions
from trainers.families.rollout import (
    GRPOBatch,
    ReusedRollout,
    RLPrompt,
    completion_logps,
    generate_rollout,
    micro_batch_spans,
    reference_logps,
    rollout_seed,
)
from trainers.losses.advantages import group_advantages, group_reward_metrics, rloo_advantages, sequence_kl
from trainers.rewards.reward_set import RewardSet


class GroupRolloutConfig(Protocol):
    """The hyperparameters the family reads (``GRPOConfig``, ``RLOOConfig``); an estimator may read more."""

    num_generations: int
    beta: float
    num_iterations: int
    mask_truncated_completions: bool
    max_completion_length: int
    temperature: float
    top_p: float


@dataclass(frozen=True)
class AdvantageEstimator:
    """``compute(rewards [N], num_generations, sequence_kl [N] | None, config) -> advantages [N]``, each
    prompt's completions adjacent. ``kl_in_reward``: the estimator penalises each completion's reward by its
    KL to the reference (then given as ``sequence_kl``); otherwise the KL, if any, is a term of the policy
    loss."""

    name: str
    compute: Callable[[torch.Tensor, int, torch.Tensor | None, GroupRolloutConfig], torch.Tensor]
    kl_in_reward: bool


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}

EstimatorFn = Callable[[torch.Tensor, int, torch.Tensor | None, GroupRolloutConfig], torch.Tensor]


def register_advantage_estimator(
    name: str, *, kl_in_reward: bool = False
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Register ``fn`` as the advantage estimator ``name`` (a name is registered once)."""

    def register(fn: EstimatorFn) -> EstimatorFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(name, fn, kl_in_reward)
        return fn

    return register


@register_advantage_estimator("grpo")
def grpo_estimator(
    rewards: torch.Tensor, k: int, kl: torch.Tensor | None, config: GroupRolloutConfig
) -> torch.Tensor:
    """(r_i - mean of the group) / std, the std as ``config.scale_rewards`` says (``group_advantages``)."""
    scale: str = getattr(config, "scale_rewards")  # noqa: B009  (GRPO's own hyperparameter)
    return group_advantages(rewards, k, scale)


@register_advantage_estimator("rloo", kl_in_reward=True)
def rloo_estimator(
    rewards: torch.Tensor, k: int, kl: torch.Tensor | None, config: GroupRolloutConfig
) -> torch.Tensor:
    """r_i - β KL_i minus the mean of its k - 1 siblings', whitened if ``config.normalize_advantages``."""
    normalize: bool = getattr(config, "normalize_advantages")  # noqa: B009  (RLOO's own hyperparameter)
    return rloo_advantages(rewards, k, kl=kl, beta=config.beta, normalize=normalize)


# A micro-batch's share of the step's loss denominator, from its loss mask [N, T].
LOSS_UNITS: dict[str, Callable[[torch.Tensor, GroupRolloutConfig], int]] = {
    "grpo": lambda mask, config: int(mask.size(0)),  # each completion's token mean, averaged
    "dr_grpo": lambda mask, config: int(mask.size(0)) * config.max_completion_length,
    "dapo": lambda mask, config: int(mask.sum()),  # one mean over every token of the step
}


class GroupRollouts(ReusedRollout[GRPOBatch]):
    """The loop's ``StepPreparer`` of the family: sample, score, take the named estimator's advantages,
    split into micro-batches with π_old (``num_iterations`` > 1) and the reference's log-probs (β > 0)."""

    def __init__(
        self,
        config: GroupRolloutConfig,
        tokenizer: PreTrainedTokenizerBase,
        rewards: RewardSet,
        reference: torch.nn.Module | None,
        *,
        advantage: str,
        loss_units: str,
    ) -> None:
        super().__init__(GRPOBatch, config.num_iterations)
        self.config, self.tokenizer, self.rewards, self.reference = config, tokenizer, rewards, reference
        self.estimator = ADVANTAGE_ESTIMATORS[advantage]
        self.units = LOSS_UNITS[loss_units]

    def rollout(self, model: torch.nn.Module, examples: list[Sequence[RLPrompt]]) -> PreparedStep[GRPOBatch]:
        c, k = self.config, self.config.num_generations
        kl_in_reward = self.estimator.kl_in_reward and c.beta != 0.0
        rollout = generate_rollout(
            model,
            self.tokenizer,
            [p for group in examples for p in group],
            num_generations=k,
            max_completion_length=c.max_completion_length,
            temperature=c.temperature,
            top_p=c.top_p,
            seed=rollout_seed(),
        )
        scores = self.rewards.score(rollout.prompts, rollout.completions, rollout.columns)
        loss_mask = rollout.loss_mask(c.mask_truncated_completions)
        spans = micro_batch_spans([len(group) * k for group in examples])
        parts, olds, refs, kls = [], [], [], []
        for rows in spans:
            part = rollout.select(rows)
            old = ref = None
            if c.num_iterations > 1 or kl_in_reward:
                with torch.no_grad():
                    old = completion_logps(model, *part.inputs, temperature=c.temperature)[0]
            if c.beta != 0.0:
                ref = reference_logps(model, self.reference, *part.inputs, temperature=c.temperature)
            if kl_in_reward:
                assert old is not None and ref is not None
                kls.append(sequence_kl(old, ref, loss_mask[rows, : part.width]).cpu())
            parts.append(part)
            olds.append(old if c.num_iterations > 1 else None)
            refs.append(None if kl_in_reward else ref)
        # every rank's completions: a batch-wide normalisation and the metrics are the step's
        step = step_completions(scores, rollout, *([torch.cat(kls)] if kls else []))
        kl = step.extra[0] if kls else None
        advantages = self.estimator.compute(step.scores.total, k, kl, c)[step.mine]
        device = rollout.completion_ids.device
        units = [self.units(loss_mask[rows], c) for rows in spans]
        step_units, step_tokens = dist.sum_floats([sum(units), float(loss_mask.sum())], device)
        step_tokens = max(1.0, step_tokens)
        batches = [
            GRPOBatch(
                prompt_ids=part.prompt_ids,
                prompt_mask=part.prompt_mask,
                completion_ids=part.completion_ids,
                completion_mask=loss_mask[rows, : part.width],
                advantages=advantages[rows].to(device),
                old_logps=old,
                ref_logps=ref,
                loss_units=n_units,
                metric_scale=max(1.0, step_units) / step_tokens,
            )
            for rows, part, old, ref, n_units in zip(spans, parts, olds, refs, units, strict=True)
        ]
        metrics = {
            **group_reward_metrics(step.scores.total, k),
            **step.completion_metrics(),
            **step.scores.metrics(),
        }
        if kl is not None:
            metrics["kl"] = float(kl.sum()) / step_tokens
        return PreparedStep(batches, metrics)
