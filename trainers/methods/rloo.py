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


def rloo_rollouts(
    config: RLOOConfig,
    tokenizer: PreTrainedTokenizerBase,
    rewards: RewardSet,
    reference: torch.nn.Module | None,
) -> GroupRollouts:
    """RLOO's step preparer: the group-rollout family with the ``rloo`` advantage estimator (the KL in the
    reward) and one loss unit per completion (the ``grpo`` normalisation: the loss is of whole sequences)."""
    return GroupRollouts(config, tokenizer, rewards, reference, advantage="rloo", loss_units="grpo")


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
        config, train_rows, valid_rows, callbacks, rewards, rloo_rollouts, rloo_batch_loss
    )
