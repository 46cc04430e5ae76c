"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", Algorithm 1):
sample two completions per prompt from the policy being trained, let a judge pick the better one, and take
a DPO step on that freshly judged pair:

    L(θ) = -log σ(β log[π_θ(y_w|x) / π_ref(y_w|x)] - β log[π_θ(y_l|x) / π_ref(y_l|x)])

(Rafailov et al. 2023, eq. 7; IPO's squared loss through ``loss_type``). The judge is the job's grader: a
verifiable check, or a tenant reward model through a ``score_model`` grader; the completion it scores
higher is y_w. A pair the judge cannot order (equal scores, or a score missing) carries no preference and
no loss — TRL instead makes the first sample y_w on a tie, which with 0/1 graders trains on coin flips.
Log-probabilities are the policy's own (temperature 1), as DPO's likelihoods; ``temperature`` only shapes
the sampling. Each optimizer step of the shared loop (``trainers.core.loop``) samples a pair for each of
``batch_size * gradient_accumulation_steps`` prompts.

    python -c "
    from trainers.methods.online_dpo import OnlineDPOConfig, train_online_dpo
    from trainers.rewards.graders import build_grader; from trainers.families.rl import RewardSet
    from trainers.modeling.tiny_model import build_tiny_model
    rows = [{'prompt': 'The capital of Peru is'}] * 16
    grader = build_grader({'type': 'string_check', 'name': 'e', 'operation': 'like',
                           'input': '{{sample.output_text}}', 'reference': 'e'})
    config = OnlineDPOConfig(str(build_tiny_model('/tmp/tiny')), '/tmp/odpo-out', max_steps=10)
    print(train_online_dpo(config, rows, rewards=RewardSet.of([grader])))"
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import PreTrainedTokenizerBase

from trainers.core.callbacks import TrainingCallbacks, TrainResult
from trainers.core.config import RolloutConfig, knob
from trainers.core.loop import LossSums, PreparedStep
from trainers.families.entry import Rows
from trainers.families.rl import eos_penalized, step_completions, train_on_rollouts
from trainers.families.rollout import (
    ReusedRollout,
    RLPrompt,
    RolloutBatch,
    completion_logps,
    generate_rollout,
    micro_batch_spans,
    reference_logps,
    rollout_seed,
)
from trainers.losses.advantages import JudgedPairs, judge_pairs
from trainers.losses.rl import online_dpo_loss
from trainers.rewards.reward_set import RewardScores, RewardSet


@dataclass
class OnlineDPOConfig(RolloutConfig):
    """Configuration of an online DPO run: ``RolloutConfig``'s fields plus the ``online_dpo`` entry's own
    hyperparameters (``trainers.registry``; docs/methods.md lists them with their docs and ranges), read
    as follows.

    ``temperature`` only shapes the sampling: DPO's log-probs are at temperature 1. The reference is the
    base model: the adapter disabled for LoRA, a frozen copy for full fine-tuning. ``loss_type="ipo"`` is
    on summed log-ratios, as TRL's online DPO. ``missing_eos_penalty`` applies before judging, which
    teaches the policy to finish. ``batch_size`` counts prompts (pairs) per micro-batch, so the forward
    pass sees 2 * batch_size sequences.
    """

    method: ClassVar[str] = "online_dpo"

    learning_rate: float = knob("online_dpo", "learning_rate")
    temperature: float = knob("online_dpo", "temperature")
    beta: float = knob("online_dpo", "beta")
    loss_type: str = knob("online_dpo", "loss_type")
    missing_eos_penalty: float | None = knob("online_dpo", "missing_eos_penalty")


# -- batches --------------------------------------------------------------------------------------------
@dataclass
class OnlineDPOBatch(RolloutBatch):
    """The pairs of some prompts: [2n, P] prompts and [2n, C] completions (each prompt's two adjacent),
    their [2n] summed reference log-probs, and the judge's verdict on each pair ([n] indices into the 2n)."""

    ref_logps: torch.Tensor
    chosen: torch.Tensor
    rejected: torch.Tensor
    judged: torch.Tensor

    @property
    def loss_denominator(self) -> int:
        return int(self.judged.sum())

    @property
    def pairs(self) -> JudgedPairs:
        return JudgedPairs(self.chosen, self.rejected, self.judged)


def sequence_logps(model: torch.nn.Module, batch: OnlineDPOBatch) -> torch.Tensor:
    """[2n] log π(y|x), summed over each completion's tokens, at temperature 1 (the policy's likelihood)."""
    args = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    return (completion_logps(model, *args)[0] * batch.completion_mask).sum(dim=1)


def online_dpo_batch_loss(
    model: torch.nn.Module, batch: OnlineDPOBatch, *, config: OnlineDPOConfig
) -> LossSums:
    """Summed DPO loss of a micro-batch's judged pairs (one unit per judged pair), with DPO's metrics."""
    logps = sequence_logps(model, batch)
    pairs = batch.pairs
    losses, chosen_rewards, rejected_rewards = online_dpo_loss(
        logps, batch.ref_logps, pairs, beta=config.beta, loss_type=config.loss_type
    )
    judged = pairs.judged.to(logps.dtype)
    detached = logps.detach()
    metrics = {
        "rewards/chosen": chosen_rewards * judged,
        "rewards/rejected": rejected_rewards * judged,
        "rewards/margins": (chosen_rewards - rejected_rewards) * judged,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).to(judged.dtype) * judged,
        "logps/chosen": detached[pairs.chosen] * judged,
        "logps/rejected": detached[pairs.rejected] * judged,
    }
    return LossSums(loss=losses.sum(), metrics={k: float(v.sum()) for k, v in metrics.items()})


# -- rollouts -------------------------------------------------------------------------------------------
class OnlineDPORollouts(ReusedRollout[OnlineDPOBatch]):
    """The loop's ``StepPreparer`` for online DPO: sample two completions per prompt, judge each pair with
    the reward functions, compute the reference log-probs, split into micro-batches."""

    def __init__(
        self,
        config: OnlineDPOConfig,
        tokenizer: PreTrainedTokenizerBase,
        rewards: RewardSet,
        reference: torch.nn.Module | None,
    ) -> None:
        super().__init__(OnlineDPOBatch, 1)
        self.config, self.tokenizer, self.rewards, self.reference = config, tokenizer, rewards, reference

    def rollout(
        self, model: torch.nn.Module, examples: list[Sequence[RLPrompt]]
    ) -> PreparedStep[OnlineDPOBatch]:
        c = self.config
        seed = rollout_seed()
        rollout = generate_rollout(
            model,
            self.tokenizer,
            [p for group in examples for p in group],
            num_generations=2,
            max_completion_length=c.max_completion_length,
            temperature=c.temperature,
            top_p=c.top_p,
            seed=seed,
        )
        rewards = self.rewards.score(rollout.prompts, rollout.completions, rollout.columns)
        step = step_completions(rewards, rollout)  # every rank's completions, for the step's metrics
        step_scores = self._scores(step.scores, step.truncated)
        pairs = judge_pairs(step_scores[step.mine])
        device = rollout.completion_ids.device
        batches = []
        for rows in micro_batch_spans([2 * len(group) for group in examples]):
            part = rollout.select(rows)
            ref = reference_logps(model, self.reference, *part.inputs)
            pair_rows = slice(rows.start // 2, rows.stop // 2)
            batches.append(
                OnlineDPOBatch(
                    *part.inputs,
                    ref_logps=(ref * part.completion_mask).sum(dim=1),
                    chosen=(pairs.chosen[pair_rows] - rows.start).to(device),
                    rejected=(pairs.rejected[pair_rows] - rows.start).to(device),
                    judged=pairs.judged[pair_rows].to(device),
                )
            )
        step_pairs = judge_pairs(step_scores)
        judged = step_pairs.judged
        margin = step_scores[step_pairs.chosen] - step_scores[step_pairs.rejected]
        metrics = {
            "reward": float(torch.nanmean(step.scores.total)),
            "frac_pairs_judged": float(judged.float().mean()),
            "scores_margin": float(margin[judged].mean()) if judged.any() else 0.0,
            **step.completion_metrics(),
            **step.scores.metrics(),
        }
        return PreparedStep(batches, metrics)

    def _scores(self, rewards: RewardScores, truncated: torch.Tensor) -> torch.Tensor:
        """What the judge compares: the rewards, less ``missing_eos_penalty`` without EOS."""
        return eos_penalized(rewards.total, truncated, self.config.missing_eos_penalty)


# -- entry point ----------------------------------------------------------------------------------------
def train_online_dpo(
    config: OnlineDPOConfig,
    train_rows: Rows,
    valid_rows: Rows | None = None,
    callbacks: TrainingCallbacks | None = None,
    *,
    rewards: RewardSet | None = None,
) -> TrainResult:
    """Train ``config.model_path`` with online DPO on the prompts of ``train_rows``, the pairs judged by
    the total of ``rewards``."""
    return train_on_rollouts(
        config, train_rows, valid_rows, callbacks, rewards, OnlineDPORollouts, online_dpo_batch_loss
    )
