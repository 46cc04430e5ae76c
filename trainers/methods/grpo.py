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
prompts on the shared loop (``trainers.core.loop``), reused for ``num_iterations`` steps.

    python -c "
    from trainers.methods.grpo import GRPOConfig, train_grpo
    from trainers.rewards.graders import build_grader
    from trainers.families.rl import RewardSet; from trainers.modeling.tiny_model import build_tiny_model
    rows = [{'prompt': 'The capital of Peru is'}] * 16
    grader = build_grader({'type': 'string_check', 'name': 'e', 'operation': 'like',
                           'input': '{{sample.output_text}}', 'reference': 'e'})
    config = GRPOConfig(str(build_tiny_model('/tmp/tiny')), '/tmp/grpo-out', max_steps=10)
    print(train_grpo(config, rows, rewards=RewardSet.of([grader])))"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import PreTrainedTokenizerBase

from trainers.core.callbacks import TrainingCallbacks, TrainResult
from trainers.core.config import RolloutConfig, knob
from trainers.core.loop import LossSums
from trainers.families.entry import Rows
from trainers.families.group_rollout import GroupRollouts
from trainers.families.rl import train_on_rollouts
from trainers.families.rollout import GRPOBatch, completion_logps
from trainers.losses.rl import grpo_loss_terms
from trainers.rewards.reward_set import RewardSet


@dataclass
class GRPOConfig(RolloutConfig):
    """Configuration of a GRPO run: ``RolloutConfig``'s fields plus the ``grpo`` entry's own
    hyperparameters (``trainers.registry``; docs/methods.md lists them with their docs and ranges), read
    as follows.

    The advantage compares the ``num_generations`` completions of a prompt. ``beta`` 0 skips the reference
    entirely; otherwise the reference is the base model: the adapter disabled for LoRA, a frozen copy for
    full training. ``num_iterations`` > 1 keeps the rollout's log-probs as π_old. ``batch_size`` counts
    prompts per micro-batch, each with ``num_generations`` completions.
    """

    method: ClassVar[str] = "grpo"

    learning_rate: float = knob("grpo", "learning_rate")
    num_generations: int = knob("grpo", "num_generations")
    beta: float = knob("grpo", "beta")
    epsilon: float = knob("grpo", "epsilon")
    epsilon_high: float | None = knob("grpo", "epsilon_high")
    loss_type: str = knob("grpo", "loss_type")
    scale_rewards: str = knob("grpo", "scale_rewards")
    num_iterations: int = knob("grpo", "num_iterations")
    mask_truncated_completions: bool = knob("grpo", "mask_truncated_completions")


# -- batches --------------------------------------------------------------------------------------------


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


def grpo_rollouts(
    config: GRPOConfig,
    tokenizer: PreTrainedTokenizerBase,
    rewards: RewardSet,
    reference: torch.nn.Module | None,
) -> GroupRollouts:
    """GRPO's step preparer: the group-rollout family with the ``grpo`` advantage estimator and the
    normalisation ``config.loss_type`` names."""
    return GroupRollouts(config, tokenizer, rewards, reference, advantage="grpo", loss_units=config.loss_type)


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
        config, train_rows, valid_rows, callbacks, rewards, grpo_rollouts, grpo_batch_loss
    )
