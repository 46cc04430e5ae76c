"""REINFORCE Leave-One-Out (RLOO): sample k completions per prompt, score them, and raise the likelihood of
each completion in proportion to how much better it scored than the mean of its k - 1 siblings
(Ahmadian et al. 2024, "Back to Basics", eq. 6), with a sequence-level KL penalty in the reward:

    ∇J(θ) = 1/k Σ_i [R(y_i, x) - 1/(k-1) Σ_{j≠i} R(y_j, x)] ∇ log π_θ(y_i | x),
    R(y, x) = r(y, x) - β Σ_t (log π_old(y_t | x, y_<t) - log π_ref(y_t | x, y_<t))

The whole completion is one action: the importance ratio is of sequence log-probs, clipped as in PPO
when a rollout is reused for ``num_iterations`` steps (with one step per rollout the ratio is 1 and this
is plain REINFORCE with the leave-one-out baseline). Each optimizer step of the shared loop
(``trainers.core.loop``) samples ``num_generations`` completions for each of
``batch_size * gradient_accumulation_steps`` prompts.

    python -c "
    from trainers.methods.rloo import RLOOConfig, train_rloo
    from trainers.rewards.graders import build_grader
    from trainers.families.rl import RewardSet; from trainers.modeling.tiny_model import build_tiny_model
    rows = [{'prompt': 'The capital of Peru is'}] * 16
    grader = build_grader({'type': 'string_check', 'name': 'e', 'operation': 'like',
                           'input': '{{sample.output_text}}', 'reference': 'e'})
    config = RLOOConfig(str(build_tiny_model('/tmp/tiny')), '/tmp/rloo-out', max_steps=10)
    print(train_rloo(config, rows, rewards=RewardSet.of([grader])))"
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import PreTrainedTokenizerBase

from trainers.core import distributed as dist
from trainers.core.callbacks import TrainingCallbacks, TrainResult
from trainers.core.config import RolloutConfig, knob
from trainers.core.loop import LossSums, PreparedStep
from trainers.families.entry import Rows
from trainers.families.rl import step_completions, train_on_rollouts
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
from trainers.losses.advantages import group_reward_metrics, rloo_advantages, sequence_kl
from trainers.losses.rl import rloo_loss_terms
from trainers.rewards.reward_set import RewardSet


@dataclass
class RLOOConfig(RolloutConfig):
    """Configuration of an RLOO run: ``RolloutConfig``'s fields plus the ``rloo`` entry's own
    hyperparameters (``trainers.registry``; docs/methods.md lists them with their docs and ranges), read
    as follows.

    Each completion's baseline is the mean reward of the other ``num_generations`` - 1 of its prompt.
    ``beta`` 0 skips the reference entirely; otherwise the reference is the base model: the adapter
    disabled for LoRA, a frozen copy otherwise. The sequence ratio clip (``epsilon``, ``epsilon_high``)
    matters only with ``num_iterations`` > 1, which keeps the rollout's log-probs as π_old.
    ``normalize_advantages`` whitens over the step's completions. ``batch_size`` counts prompts per
    micro-batch, each with ``num_generations`` completions.
    """

    method: ClassVar[str] = "rloo"

    learning_rate: float = knob("rloo", "learning_rate")
    num_generations: int = knob("rloo", "num_generations")
    beta: float = knob("rloo", "beta")
    epsilon: float = knob("rloo", "epsilon")
    epsilon_high: float | None = knob("rloo", "epsilon_high")
    num_iterations: int = knob("rloo", "num_iterations")
    normalize_advantages: bool = knob("rloo", "normalize_advantages")
    mask_truncated_completions: bool = knob("rloo", "mask_truncated_completions")

    @property
    def uses_reference(self) -> bool:
        return self.beta != 0.0


# -- the method -----------------------------------------------------------------------------------------
def rloo_batch_loss(model: torch.nn.Module, batch: GRPOBatch, *, config: RLOOConfig) -> LossSums:
    """Summed RLOO loss of a micro-batch (one unit per completion), with its clipped-sequence count and
    entropy sum scaled to a token mean."""
    logps, entropy = completion_logps(
        model,
        batch.prompt_ids,
        batch.prompt_mask,
        batch.completion_ids,
        batch.completion_mask,
        temperature=config.temperature,
    )
    mask = batch.completion_mask.to(logps.dtype)
    old = batch.old_logps if batch.old_logps is not None else logps.detach()
    terms = rloo_loss_terms(
        logps,
        (old * mask).sum(dim=1),
        batch.advantages,
        mask,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high,
    )
    metrics = {
        "clip_ratio": float(terms.clip_sum),
        "entropy": float((entropy * mask).sum()) * batch.metric_scale,
    }
    return LossSums(loss=terms.loss_sum, metrics=metrics)


class RLOORollouts(ReusedRollout[GRPOBatch]):
    """The loop's ``StepPreparer`` for RLOO: sample k completions per prompt, score them, subtract the
    KL penalty, take leave-one-out advantages, split into micro-batches (``GRPOBatch``: the same tensors)."""

    def __init__(
        self,
        config: RLOOConfig,
        tokenizer: PreTrainedTokenizerBase,
        rewards: RewardSet,
        reference: torch.nn.Module | None,
    ) -> None:
        super().__init__(GRPOBatch, config.num_iterations)
        self.config, self.tokenizer, self.rewards, self.reference = config, tokenizer, rewards, reference

    def rollout(self, model: torch.nn.Module, examples: list[Sequence[RLPrompt]]) -> PreparedStep[GRPOBatch]:
        c, k = self.config, self.config.num_generations
        seed = rollout_seed()
        rollout = generate_rollout(
            model,
            self.tokenizer,
            [p for group in examples for p in group],
            num_generations=k,
            max_completion_length=c.max_completion_length,
            temperature=c.temperature,
            top_p=c.top_p,
            seed=seed,
        )
        scores = self.rewards.score(rollout.prompts, rollout.completions, rollout.columns)
        loss_mask = rollout.loss_mask(c.mask_truncated_completions)
        spans = micro_batch_spans([len(group) * k for group in examples])
        parts, olds, kls = [], [], []
        for rows in spans:
            part = rollout.select(rows)
            old = None
            if c.num_iterations > 1 or c.beta != 0.0:
                with torch.no_grad():
                    old = completion_logps(model, *part.inputs, temperature=c.temperature)[0]
            if c.beta != 0.0:
                assert old is not None
                ref = reference_logps(model, self.reference, *part.inputs, temperature=c.temperature)
                kls.append(sequence_kl(old, ref, loss_mask[rows, : part.width]).cpu())
            parts.append(part)
            olds.append(old if c.num_iterations > 1 else None)
        # every rank's completions: the normalisation and the metrics are the step's
        step = step_completions(scores, rollout, *([torch.cat(kls)] if kls else []))
        kl = step.extra[0] if kls else None
        advantages = rloo_advantages(
            step.scores.total, k, kl=kl, beta=c.beta, normalize=c.normalize_advantages
        )[step.mine]
        device = rollout.completion_ids.device
        step_tokens = max(1.0, dist.sum_floats([float(loss_mask.sum())], device)[0])
        batches = [
            GRPOBatch(
                prompt_ids=part.prompt_ids,
                prompt_mask=part.prompt_mask,
                completion_ids=part.completion_ids,
                completion_mask=loss_mask[rows, : part.width],
                advantages=advantages[rows].to(device),
                old_logps=old,
                ref_logps=None,
                loss_units=rows.stop - rows.start,
                metric_scale=len(step.lengths) / step_tokens,
            )
            for rows, part, old in zip(spans, parts, olds, strict=True)
        ]
        metrics = {
            **group_reward_metrics(step.scores.total, k),
            **step.completion_metrics(),
            **step.scores.metrics(),
        }
        if kl is not None:
            metrics["kl"] = float(kl.sum()) / step_tokens
        return PreparedStep(batches, metrics)


# -- entry point ----------------------------------------------------------------------------------------
def train_rloo(
    config: RLOOConfig,
    train_rows: Rows,
    valid_rows: Rows | None = None,
    callbacks: TrainingCallbacks | None = None,
    *,
    rewards: RewardSet | None = None,
) -> TrainResult:
    """Train ``config.model_path`` with RLOO on the prompts of ``train_rows``, rewarded by ``rewards``."""
    return train_on_rollouts(
        config, train_rows, valid_rows, callbacks, rewards, RLOORollouts, rloo_batch_loss
    )
