"""What the methods trained on preference pairs without a reference model (ORPO, CPO, SimPO, reward
models) share: one forward pass over a pair batch giving the completion log-probs and the chosen rows'
NLL, and the run (rows -> loop).

The NLL term of these objectives is TRL's: the mean token cross-entropy over the chosen rows of a
micro-batch. The loop's loss unit is a pair, so a micro-batch of B pairs contributes B · NLL to the summed
loss: divided by the B pairs of a one-micro-batch step, that is the batch's NLL, as TRL computes it; with
gradient accumulation each micro-batch's NLL is weighted by its pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from trainers.core.callbacks import TrainingCallbacks, TrainResult
from trainers.core.config import TrainingConfig, knob
from trainers.core.loop import LossSums, TrainingTask, run_training
from trainers.data.preference import PreferenceBatch, collate_preferences, tokenize_preference_rows
from trainers.families.entry import Rows, begin_on_rows, load_model_to_train
from trainers.modeling.loading import pair_packing, pick_device, row_sums, target_log_probs

if TYPE_CHECKING:
    from trainers.rewards.reward_set import RewardSet


@dataclass(frozen=True)
class PairForward:
    """One forward pass over B pairs (2B rows: chosen, then rejected)."""

    logps: torch.Tensor  # [2B] summed completion log-probs
    lengths: torch.Tensor  # [2B] completion tokens, float
    chosen_nll: torch.Tensor  # scalar: mean token NLL over the chosen rows' targets

    @property
    def mean_logps(self) -> torch.Tensor:
        """[2B] completion log-probs averaged per token (SimPO's and ORPO's length normalisation)."""
        return self.logps / self.lengths.clamp(min=1)


def pair_forward(
    model: torch.nn.Module, batch: PreferenceBatch, *, nll_on_prompt: bool, nll_grad: bool = True
) -> PairForward:
    """Run ``model`` on the pairs; the chosen NLL covers the completion tokens, plus the prompt's (every
    token but the first) when ``nll_on_prompt`` (ORPO's original implementation and TRL's). Without
    ``nll_grad`` the NLL is computed for the metrics only, outside the autograd graph."""
    n = batch.n_pairs
    completions = batch.completion_mask.bool()
    # the NLL's targets: the chosen rows' completions, or their every token but the first (column 0 of a
    # target mask is never a target)
    nll_targets = torch.zeros_like(completions)
    nll_targets[:n] = batch.attention_mask[:n].bool() if nll_on_prompt else completions[:n]
    # one pass over the union of both sets of targets
    targets = completions | nll_targets
    token_logps = target_log_probs(
        model,
        batch.input_ids,
        batch.attention_mask,
        targets,
        packed=batch.packed,
        extra_inputs=batch.extra_inputs,
    )
    logps = row_sums(torch.where(completions[:, 1:][targets[:, 1:]], token_logps, 0.0), targets)
    nll_logps = token_logps[nll_targets[:, 1:][targets[:, 1:]]]
    chosen_nll = -nll_logps.sum() / max(nll_logps.numel(), 1)
    if not nll_grad:
        chosen_nll = chosen_nll.detach()
    lengths = batch.completion_mask[:, 1:].sum(dim=1).float()
    return PairForward(logps=logps, lengths=lengths, chosen_nll=chosen_nll)


def pair_metrics(
    out: PairForward, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, logps: torch.Tensor
) -> dict[str, float | torch.Tensor]:
    """The metrics every pair method reports, summed over the B pairs (the loop averages them):
    implicit rewards, accuracy and margin, the log-probs the loss used (``logps`` [2B]), the chosen NLL.
    Scalar tensors: the loop reads them once per step, not once per micro-batch."""
    n = chosen_rewards.shape[0]
    logps = logps.detach()
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards.sum(),
        "rewards/rejected": rejected_rewards.sum(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).sum().float(),
        "rewards/margins": (chosen_rewards - rejected_rewards).sum(),
        "logps/chosen": logps[:n].sum(),
        "logps/rejected": logps[n:].sum(),
        "nll_loss": n * out.chosen_nll.detach(),
    }


@dataclass
class PairConfig(TrainingConfig):
    """``TrainingConfig``'s fields plus the data hyperparameters of a pair method (declared alike by
    ORPO, CPO, SimPO and the reward model in ``trainers.registry``): a pair left with no chosen or no
    rejected token after truncation to ``max_length`` is dropped. ``batch_size`` counts pairs, so the
    forward pass sees 2 * batch_size sequences.
    """

    max_length: int = knob("reward_model", "max_length")
    max_prompt_length: int | None = knob("reward_model", "max_prompt_length")


# (config, device, pad token id) -> the model to train
ModelLoader = Callable[[PairConfig, torch.device, int], torch.nn.Module]


def causal_lm(config: PairConfig, device: torch.device, pad_token_id: int) -> torch.nn.Module:
    del pad_token_id  # the tokenizer's, already in the model's config
    return load_model_to_train(config, device)


def train_on_pairs(
    config: PairConfig,
    loss_fn: Callable[[torch.nn.Module, PreferenceBatch], LossSums],
    train_rows: Rows,
    valid_rows: Rows | None = None,
    callbacks: TrainingCallbacks | None = None,
    *,
    rewards: RewardSet | None = None,
    load: ModelLoader = causal_lm,
) -> TrainResult:
    """Train the model ``load`` gives (by default the causal LM ``config.model_path``) on preference rows
    with ``loss_fn``, without a reference model; raise ``DataError`` when the data is at fault."""
    tokenizer, train, valid = begin_on_rows(
        config,
        tokenize_preference_rows,
        train_rows,
        valid_rows,
        rewards=rewards,
        max_length=config.max_length,
        max_prompt_length=config.max_prompt_length,
    )
    pad_id = tokenizer.pad_token_id
    assert isinstance(pad_id, int)
    model = load(config, pick_device(), pad_id)
    collate = partial(collate_preferences, pad_token_id=pad_id, pack=pair_packing(model))
    return run_training(config, TrainingTask(model, tokenizer, train, collate, loss_fn, valid), callbacks)
