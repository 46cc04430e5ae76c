"""What every online RL method shares (GRPO, PPO; RLOO and online DPO build on it too): the reward set,
the completion metrics and the frozen reference. Sampling and log-probs are in ``trainers.families.rollout``.

A method's ``StepPreparer`` uses it like this:

    rollout = generate_rollout(model, tokenizer, prompts, ...)          # trainers.families.rollout
    scores = rewards.score(rollout.prompts, rollout.completions, rollout.columns)
    scores.total        # [N] weighted sum of the rewards; NaN where no reward function scored
    scores.scored       # [N] bool, False where total is NaN: such a completion carries no reward signal
    metrics = {**scores.metrics(), **completion_metrics(rollout.completion_mask, rollout.truncated)}

and its train function gets the reference once, ``reference = frozen_reference(config, device, kl=...)``,
then ``rollout.reference_logps(model, reference, ...)``, and its validation pass (the task's ``evaluate``)
from ``reward_evaluator(config, tokenizer, valid_rows, rewards)``: the same sampling and the same reward
set on the validation prompts, one completion each, greedy by default. ``train_on_rollouts`` is that
whole train function for the methods whose only trainable is the policy (GRPO, RLOO, online DPO): the
method gives its step preparer and its loss.

Rewards: a reward function may return ``None`` for a completion it cannot judge (e.g. no answer to
check): that score is NaN; the total is the weighted sum of the scores that exist (NaN only when no
function scored the completion), and ``rewards/{name}/unscored`` counts each function's ``None`` per
step. Every method gives an unscored completion no reward signal: GRPO and RLOO an advantage of 0, PPO
leaves it out of the loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from trainers.core import distributed as dist
from trainers.core.callbacks import TrainingCallbacks, TrainResult
from trainers.core.config import RolloutConfig, TrainingConfig
from trainers.core.loop import Batch, LossSums, StepPreparer, TrainingTask, run_training
from trainers.families.entry import Rows, begin_training, load_model_to_train
from trainers.families.rollout import (
    RLPrompt,
    Rollout,
    generate_rollout,
    load_frozen_reference,
    rollout_only,
    tokenize_rl_rows,
)
from trainers.modeling.loading import pick_device
from trainers.rewards.reward_set import RewardScores, RewardSet

BatchT = TypeVar("BatchT", bound=Batch)

__all__ = [
    "StepCompletions",
    "completion_metrics",
    "frozen_reference",
    "reward_evaluator",
    "step_completions",
    "train_on_rollouts",
    "validation_metrics",
]


def validation_metrics(scores: RewardScores) -> dict[str, float]:
    """An RL validation pass's metrics: ``valid_reward``, the mean weighted reward of the completions
    some reward function scored, and ``valid_reward/{name}``, each function's mean over those it scored.
    A mean over no scored completion is left out (absent, rather than NaN in the job's metrics).

    >>> s = RewardSet.of([lambda p, c: [1.0, 0.0, None], lambda p, c: [0.5, None, None]], weights=[1, 2])
    >>> validation_metrics(s.score(["q"] * 3, ["a", "b", "c"], {}))
    {'valid_reward': 1.0, 'valid_reward/reward_0': 0.5, 'valid_reward/reward_1': 0.5}
    """
    means = {"valid_reward": float(torch.nanmean(scores.total))}
    for i, name in enumerate(scores.names):
        means[f"valid_reward/{name}"] = float(torch.nanmean(scores.per_func[:, i]))
    return {key: value for key, value in means.items() if not math.isnan(value)}


def reward_evaluator(
    config: RolloutConfig,
    tokenizer: PreTrainedTokenizerBase,
    valid_rows: Rows | None,
    rewards: RewardSet,
) -> Callable[[torch.nn.Module], dict[str, float]] | None:
    """The validation pass of an online method (a ``TrainingTask.evaluate``), None without validation rows.

    Each pass samples one completion per validation prompt from the current policy with the training
    rollouts' own ``generate_rollout`` (greedy unless ``config.eval_sampling`` is ``sample``; sampled
    passes all start from ``config.seed``, so successive passes differ only by the policy), ``batch_size``
    prompts at a time, scores them all with the run's ``rewards`` and returns ``validation_metrics``.
    ``generate_rollout`` forks the RNG: training draws the same rollouts with or without validation.
    On several ranks each samples its every world-th chunk (the same seeds as one process) and the
    metrics are over every rank's scores.
    """
    if not valid_rows:
        return None
    prompts = tokenize_rl_rows(
        valid_rows, tokenizer, max_prompt_length=config.max_prompt_length, param="validation_file"
    )

    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        size, world = config.batch_size, dist.world_size()
        parts = [RewardScores(torch.zeros(0, len(rewards.names)), torch.zeros(0), rewards.names)]
        for start in range(dist.rank() * size, len(prompts), world * size):  # this rank's chunks
            rollout = generate_rollout(
                model,
                tokenizer,
                prompts[start : start + config.batch_size],
                num_generations=1,
                max_completion_length=config.max_completion_length,
                temperature=config.temperature,
                top_p=config.top_p,
                seed=config.seed + start,
                greedy=config.eval_sampling == "greedy",
            )
            parts.append(rewards.score(rollout.prompts, rollout.completions, rollout.columns))
        (per_func, total), _ = dist.gather_rows(
            torch.cat([p.per_func for p in parts]), torch.cat([p.total for p in parts])
        )
        return validation_metrics(RewardScores(per_func, total, rewards.names))

    return evaluate


def completion_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """Lengths of a rollout's completions ([N] tokens) and the fraction without EOS ([N] bool).

    >>> m = completion_metrics(torch.tensor([2, 3]), torch.tensor([False, True]))
    >>> m["completions/mean_length"], m["completions/clipped_ratio"]
    (2.5, 0.5)
    """
    lengths = lengths.float()
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.float().mean()),
    }


def eos_penalized(scores: torch.Tensor, truncated: torch.Tensor, penalty: float | None) -> torch.Tensor:
    """``scores`` [N] less ``penalty`` where the completion ended without EOS (``truncated`` [N]):
    PPO's and online DPO's ``missing_eos_penalty``; None leaves the scores as they are.

    >>> eos_penalized(torch.tensor([1.0, 1.0]), torch.tensor([False, True]), 0.5).tolist()
    [1.0, 0.5]
    """
    if penalty is None:
        return scores
    return scores - penalty * truncated.float().cpu()


@dataclass(frozen=True)
class StepCompletions:
    """The step's completions on every rank (on one process, its rollout's), for what is taken over the
    whole step: batch-wide advantage statistics and the step's metrics (trainers/core/distributed.py).

    ``scores``, ``lengths`` [N] and ``truncated`` [N] of every completion, ``extra``: the per-completion
    tensors the method asked for, gathered the same way, and ``mine``: this rank's rows among them.
    """

    scores: RewardScores
    lengths: torch.Tensor
    truncated: torch.Tensor
    extra: tuple[torch.Tensor, ...]
    mine: slice

    def completion_metrics(self) -> dict[str, float]:
        return completion_metrics(self.lengths, self.truncated)


def step_completions(scores: RewardScores, rollout: Rollout, *extra: torch.Tensor) -> StepCompletions:
    """Gather a rank's scored rollout (and ``extra`` tensors, one row per completion) with every other
    rank's, in one collective; nothing to gather on one process."""
    local = (scores.per_func, scores.total, rollout.completion_lengths, rollout.truncated, *extra)
    (per_func, total, lengths, truncated, *gathered), mine = dist.gather_rows(*local)
    return StepCompletions(
        RewardScores(per_func, total, scores.names), lengths, truncated, tuple(gathered), mine
    )


def frozen_reference(config: TrainingConfig, device: torch.device, *, kl: bool) -> torch.nn.Module | None:
    """The KL reference to load next to the policy: none when there is no KL term (``kl`` False) or
    with LoRA (the reference is then the policy with its adapter disabled, see
    ``trainers.families.rollout.reference_logps``); a frozen copy of the base for full fine-tuning."""
    if not kl or config.use_lora:
        return None
    return load_frozen_reference(config.model_path, device)


def train_on_rollouts(
    config: RolloutConfig,
    train_rows: Rows,
    valid_rows: Rows | None,
    callbacks: TrainingCallbacks | None,
    rewards: RewardSet | None,
    preparer: Callable[
        [Any, PreTrainedTokenizerBase, RewardSet, torch.nn.Module | None], StepPreparer[RLPrompt, BatchT]
    ],
    loss_fn: Callable[..., LossSums],
) -> TrainResult:
    """The train function of a method that learns from its own samples: check the inputs, tokenize the
    prompts, load the policy and (``config.uses_reference``) the frozen reference, then
    run the shared loop on the batches ``preparer(config, tokenizer, rewards, reference)`` builds each
    step, with the loss ``loss_fn(model, batch, config=config)``, validating with ``reward_evaluator``."""
    tokenizer = begin_training(config, valid_rows=valid_rows, rewards=rewards)
    assert rewards is not None  # begin_training refuses an RL run without rewards
    prompts = tokenize_rl_rows(train_rows, tokenizer, max_prompt_length=config.max_prompt_length)
    evaluate = reward_evaluator(config, tokenizer, valid_rows, rewards)
    device = pick_device()
    model = load_model_to_train(config, device)
    reference = frozen_reference(config, device, kl=config.uses_reference)
    task = TrainingTask(
        model,
        tokenizer,
        prompts,
        rollout_only,
        partial(loss_fn, config=config),
        preparer=preparer(config, tokenizer, rewards, reference),
        evaluate=evaluate,
    )
    return run_training(config, task, callbacks)
