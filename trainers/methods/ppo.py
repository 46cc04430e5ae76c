"""Proximal Policy Optimization for language models (Schulman et al. 2017; Ouyang et al. 2022, eq. 2):
maximise the reward of sampled completions minus a per-token KL penalty to the reference,

    r_t = -kl_coef · (log π_old(o_t) - log π_ref(o_t)) + [t = last] · score(q, o)

with the clipped surrogate (PPO eq. 7), a clipped value loss, and GAE advantages (Schulman et al. 2016,
eq. 16) whitened per rollout. Each optimizer step of the shared loop (``trainers.core.loop``) samples one
completion per prompt for ``batch_size * gradient_accumulation_steps`` prompts; that rollout is then
trained on for ``num_ppo_epochs`` passes over ``num_mini_batches`` shuffled mini-batches, one optimizer
step each. The score comes from ``reward_funcs`` (graders; a reward model is the ``score_model`` grader).

Policy and value: the value head is a separate ``Linear(hidden, 1)`` on the policy's last hidden state
(the trunk is shared: one forward pass gives both log-probs and values). With LoRA this keeps a single
copy of the base weights in memory (the reference is the same model with the adapter disabled), which is
the point; the trade-off is that the value loss also moves the shared adapter (scaled by ``vf_coef``),
so policy and critic compete for the trunk, and the critic starts from scratch instead of from a reward
model as in InstructGPT's separate value network. The head is trained with the policy by the same
optimizer and checkpointed for resume; the exported model is the policy alone (LoRA merged, no head).

    python -c "
    from trainers.methods.ppo import PPOConfig, train_ppo; from trainers.rewards.graders import build_grader
    from trainers.families.rl import RewardSet; from trainers.modeling.tiny_model import build_tiny_model
    rows = [{'prompt': 'The capital of Peru is'}] * 16
    grader = build_grader({'type': 'string_check', 'name': 'e', 'operation': 'like',
                           'input': '{{sample.output_text}}', 'reference': 'e'})
    config = PPOConfig(str(build_tiny_model('/tmp/tiny')), '/tmp/ppo-out', max_steps=8)
    print(train_ppo(config, rows, rewards=RewardSet.of([grader])))"
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any, ClassVar, Self

import torch
from transformers import PreTrainedTokenizerBase

from trainers.core import distributed as dist
from trainers.core.callbacks import TrainingCallbacks, TrainResult
from trainers.core.config import RolloutConfig, knob
from trainers.core.loop import LossSums, PreparedStep, TrainingTask, run_training
from trainers.families.entry import Rows, begin_training, load_model_to_train
from trainers.families.rl import eos_penalized, frozen_reference, reward_evaluator, step_completions
from trainers.families.rollout import (
    RLPrompt,
    forward_completion,
    generate_rollout,
    reference_logps,
    rollout_seed,
    token_logps,
    tokenize_rl_rows,
    trim_left_padding,
)
from trainers.losses.advantages import gae, masked_whiten, per_token_rewards
from trainers.losses.rl import ppo_loss_terms
from trainers.modeling.loading import pick_device
from trainers.rewards.reward_set import RewardScores, RewardSet


@dataclass
class PPOConfig(RolloutConfig):
    """Configuration of a PPO run (one completion per prompt): ``RolloutConfig``'s fields plus the ``ppo``
    entry's own hyperparameters (``trainers.registry``; docs/methods.md lists them with their docs and
    ranges), read as follows.

    ``num_mini_batches`` must divide the rollout's prompts; ``kl_coef``'s reference is the base (the
    adapter disabled for LoRA); ``whiten_advantages`` normalises over the rollout's tokens.
    ``batch_size`` counts prompts per micro-batch; ``max_steps`` counts optimizer steps, each rollout
    making ``num_ppo_epochs * num_mini_batches`` of them.
    """

    method: ClassVar[str] = "ppo"

    learning_rate: float = knob("ppo", "learning_rate")
    num_ppo_epochs: int = knob("ppo", "num_ppo_epochs")
    num_mini_batches: int = knob("ppo", "num_mini_batches")
    kl_coef: float = knob("ppo", "kl_coef")
    gamma: float = knob("ppo", "gamma")
    lam: float = knob("ppo", "lam")
    cliprange: float = knob("ppo", "cliprange")
    cliprange_value: float = knob("ppo", "cliprange_value")
    vf_coef: float = knob("ppo", "vf_coef")
    whiten_advantages: bool = knob("ppo", "whiten_advantages")
    missing_eos_penalty: float | None = knob("ppo", "missing_eos_penalty")


# -- batches --------------------------------------------------------------------------------------------
@dataclass
class PPOBatch:
    """A micro-batch of a rollout: [N, P] prompts; [N, C] completions and per-token rollout values."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    old_logps: torch.Tensor
    old_values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor

    @property
    def loss_denominator(self) -> int:
        return int(self.completion_mask.sum())

    @property
    def n_tokens(self) -> int:
        return int(self.prompt_mask.sum()) + int(self.completion_mask.sum())

    def to(self, device: torch.device) -> Self:
        moved: dict[str, Any] = {f.name: getattr(self, f.name).to(device) for f in fields(self)}
        return replace(self, **moved)

    def select(self, rows: torch.Tensor) -> PPOBatch:
        """The given rows, with all-padding columns trimmed."""
        prompt_ids, prompt_mask = trim_left_padding(self.prompt_ids[rows], self.prompt_mask[rows])
        width = max(1, int(self.completion_mask[rows].sum(dim=1).max()))
        cut = {
            f.name: getattr(self, f.name)[rows, :width]
            for f in fields(self)
            if f.name not in ("prompt_ids", "prompt_mask")
        }
        return PPOBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, **cut)


def _no_collate(examples: Sequence[RLPrompt]) -> PPOBatch:
    raise TypeError("PPO batches are built from rollouts by PPORollouts, not collated")


def policy_and_values(
    model: torch.nn.Module,
    value_head: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs, entropies, values), [N, C]: values[:, t] = V(q, o_<t), from the shared trunk."""
    out = forward_completion(
        model, prompt_ids, prompt_mask, completion_ids, completion_mask, output_hidden_states=True
    )
    logps, entropy = token_logps(out.logits, completion_ids, temperature)
    hidden = out.hidden_states[-1][:, -completion_ids.size(1) - 1 : -1]
    values = value_head(hidden).squeeze(-1).float()
    return logps, entropy, values


def ppo_batch_loss(
    model: torch.nn.Module, batch: PPOBatch, *, value_head: torch.nn.Module, config: PPOConfig
) -> LossSums:
    """Summed PPO loss of a micro-batch; metrics are token sums (the loop divides by the step's tokens)."""
    logps, entropy, values = policy_and_values(
        model,
        value_head,
        batch.prompt_ids,
        batch.prompt_mask,
        batch.completion_ids,
        batch.completion_mask,
        temperature=config.temperature,
    )
    t = ppo_loss_terms(
        logps,
        batch.old_logps,
        values,
        batch.old_values,
        batch.advantages,
        batch.returns,
        batch.completion_mask,
        cliprange=config.cliprange,
        cliprange_value=config.cliprange_value,
        vf_coef=config.vf_coef,
    )
    metrics = {
        "policy_loss": float(t.policy_sum),
        "value_loss": float(t.value_sum),
        "approx_kl": float(t.approx_kl_sum),
        "clip_fraction": float(t.clip_sum),
        "entropy": float((entropy * batch.completion_mask).sum()),
    }
    return LossSums(loss=t.loss_sum, metrics=metrics)


# -- rollouts -------------------------------------------------------------------------------------------
class PPORollouts:
    """The loop's ``StepPreparer`` for PPO: sample, score, GAE; then serve shuffled mini-batches."""

    def __init__(
        self,
        config: PPOConfig,
        tokenizer: PreTrainedTokenizerBase,
        value_head: torch.nn.Module,
        rewards: RewardSet,
        reference: torch.nn.Module | None,
    ) -> None:
        self.config, self.tokenizer, self.value_head = config, tokenizer, value_head
        self.rewards, self.reference = rewards, reference
        self.steps_per_rollout = config.num_ppo_epochs * config.num_mini_batches
        self.rollout: PPOBatch | None = None
        self.order: torch.Tensor | None = None  # [num_ppo_epochs, N] row order of each pass
        self.metrics: dict[str, float] = {}

    @torch.no_grad()
    def _new_rollout(self, model: torch.nn.Module, prompts: list[RLPrompt]) -> None:
        c = self.config
        seed = rollout_seed()
        r = generate_rollout(
            model,
            self.tokenizer,
            prompts,
            num_generations=1,
            max_completion_length=c.max_completion_length,
            temperature=c.temperature,
            top_p=c.top_p,
            seed=seed,
        )
        scored = self.rewards.score(r.prompts, r.completions, r.columns)
        # a completion no reward function scored carries no signal: it leaves the loss (mask 0)
        completion_mask = r.completion_mask * scored.scored.to(r.completion_mask.device).unsqueeze(1)
        args = (r.prompt_ids, r.prompt_mask, r.completion_ids, completion_mask)
        logps, _, values = policy_and_values(model, self.value_head, *args, temperature=c.temperature)
        ref = reference_logps(model, self.reference, *args, temperature=c.temperature) if c.kl_coef else logps
        scores = self._scores(scored, r.truncated)
        mask = completion_mask.float()  # unscored rows are all 0: gae zeroes their rewards too
        rewards, kl = per_token_rewards(scores.to(logps.device), logps, ref, mask, kl_coef=c.kl_coef)
        advantages, returns = gae(rewards, values, mask, gamma=c.gamma, lam=c.lam)
        if c.whiten_advantages:  # over the step's tokens on every rank
            advantages = masked_whiten(advantages, mask, across=dist.sum_tensor)
        self.rollout = PPOBatch(*args, logps, values * mask, advantages, returns)
        generator = torch.Generator().manual_seed(seed)
        self.order = torch.stack(
            [torch.randperm(len(prompts), generator=generator) for _ in range(c.num_ppo_epochs)]
        )
        # the step's metrics, over every rank's completions
        step = step_completions(scored, r, kl.sum(dim=1).cpu())
        has_score = step.scores.scored
        step_scores, step_kl = self._scores(step.scores, step.truncated), step.extra[0]
        returns_sum, tokens = dist.sum_floats([float((returns * mask).sum()), float(mask.sum())], mask.device)
        self.metrics = {
            "score": float(step_scores[has_score].mean()) if bool(has_score.any()) else math.nan,
            "kl": float(step_kl[has_score].mean()) if bool(has_score.any()) else math.nan,
            "returns": returns_sum / max(1.0, tokens),
            **step.completion_metrics(),
            **step.scores.metrics(),
        }

    def _scores(self, scored: RewardScores, truncated: torch.Tensor) -> torch.Tensor:
        """The score paid at the last token: the rewards (0 where none scored), less
        ``missing_eos_penalty`` without EOS."""
        return eos_penalized(
            torch.nan_to_num(scored.total, nan=0.0), truncated, self.config.missing_eos_penalty
        )

    def prepare(
        self, model: torch.nn.Module, examples: list[Sequence[RLPrompt]], repeat: int
    ) -> PreparedStep[PPOBatch]:
        if repeat == 0 or self.rollout is None or self.order is None:
            self._new_rollout(model, [p for group in examples for p in group])
        assert self.rollout is not None and self.order is not None
        epoch, mini = divmod(repeat, self.config.num_mini_batches)
        size = len(self.order[epoch]) // self.config.num_mini_batches
        rows = self.order[epoch, mini * size : (mini + 1) * size]
        micro = self.config.batch_size
        batches = [self.rollout.select(rows[i : i + micro]) for i in range(0, len(rows), micro)]
        return PreparedStep(batches, dict(self.metrics))

    def state_dict(self) -> dict[str, Any]:
        if self.rollout is None or self.order is None:
            return {}
        rollout = {f.name: getattr(self.rollout, f.name).cpu() for f in fields(self.rollout)}
        return {"rollout": rollout, "order": self.order, "metrics": self.metrics}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            device = next(self.value_head.parameters()).device
            rollout: dict[str, torch.Tensor] = state["rollout"]
            self.rollout = PPOBatch(**{k: v.to(device) for k, v in rollout.items()})
            self.order, self.metrics = state["order"], dict(state["metrics"])


# -- entry point ----------------------------------------------------------------------------------------
def train_ppo(
    config: PPOConfig,
    train_rows: Rows,
    valid_rows: Rows | None = None,
    callbacks: TrainingCallbacks | None = None,
    *,
    rewards: RewardSet | None = None,
) -> TrainResult:
    """Train ``config.model_path`` with PPO on the prompts of ``train_rows``; the score is ``rewards``'
    weighted sum (a reward model is a ``score_model`` grader, ``trainers.rewards.graders.ScoreModel``)."""
    tokenizer = begin_training(config, valid_rows=valid_rows, rewards=rewards)
    assert rewards is not None  # begin_training refuses an RL run without rewards
    prompts = tokenize_rl_rows(train_rows, tokenizer, max_prompt_length=config.max_prompt_length)
    evaluate = reward_evaluator(config, tokenizer, valid_rows, rewards)
    device = pick_device()
    model = load_model_to_train(config, device)
    model_config: Any = model.config
    value_head = torch.nn.Linear(int(model_config.hidden_size), 1)
    torch.nn.init.zeros_(value_head.weight)
    torch.nn.init.zeros_(value_head.bias)
    value_head = value_head.to(device)
    reference = frozen_reference(config, device, kl=config.uses_reference)
    preparer = PPORollouts(config, tokenizer, value_head, rewards, reference)
    task = TrainingTask(
        model,
        tokenizer,
        prompts,
        _no_collate,
        partial(ppo_batch_loss, value_head=value_head, config=config),
        preparer=preparer,
        extra_trainable=value_head,
        evaluate=evaluate,
    )
    return run_training(config, task, callbacks)


__all__ = [
    "PPOBatch",
    "PPOConfig",
    "PPORollouts",
    "train_ppo",
]
