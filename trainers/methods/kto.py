"""Kahneman-Tversky Optimization (KTO): learn from completions labelled good or bad, no pairs needed.

    L(θ) = E_(x,y) [ λ_y - v(x, y) ],  r_θ(x, y) = log π_θ(y|x) - log π_ref(y|x),
    v(x, y) = λ_D σ(β (r_θ(x, y) - z₀))  if y is desirable,   λ_U σ(β (z₀ - r_θ(x, y)))  if undesirable,
    z₀ = max(0, mean over the micro-batch of r_θ(x_i, y_j)), i != j  (detached)

(Ethayarajh et al. 2024, eqs. 7-8). The reference point z₀ estimates KL(π_θ || π_ref) from mismatched
pairs: each prompt with the completion of the example before it in the micro-batch, as TRL does
(``trainers.data.unpaired``), so ``batch_size`` must be at least 2. The reference π_ref is the starting
model, as for DPO: the adapter-disabled base for LoRA, else a frozen copy. The loss is
``trainers.losses.preference.kto_loss``; the loop is ``trainers.core.loop``.

    python -c "
    from trainers.methods.kto import KTOConfig, train_kto
    from trainers.modeling.tiny_model import build_tiny_model
    rows = [{'prompt': 'Sky blue?', 'completion': a, 'label': a == ' Yes.'} for a in [' Yes.', ' No.'] * 8]
    print(train_kto(KTOConfig(str(build_tiny_model('/tmp/tiny')), '/tmp/kto-out', max_steps=10), rows))"
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from trainers.core.callbacks import TrainingCallbacks, TrainResult
from trainers.core.config import TrainingConfig, knob
from trainers.core.loop import LossSums, TrainingTask, run_training
from trainers.data.preference import SequenceRows, stack_rows
from trainers.data.unpaired import UnpairedBatch, UnpairedExample, collate_unpaired, tokenize_unpaired_rows
from trainers.families.entry import Rows, begin_on_rows, load_model_to_train
from trainers.families.reference import (
    Reference,
    check_reference,
    pick_reference,
    policy_log_probs,
    starting_model_loader,
)
from trainers.losses.preference import kto_loss
from trainers.modeling.loading import pick_device

if TYPE_CHECKING:
    from trainers.rewards.reward_set import RewardSet


@dataclass
class KTOConfig(TrainingConfig):
    """Configuration of a KTO run: ``TrainingConfig``'s fields plus the ``kto`` entry's own hyperparameters
    (``trainers.registry``; docs/methods.md lists them with their docs and ranges), read as follows.

    A row left with no completion token after truncation is dropped. With unbalanced data, the KTO
    authors advise ``desirable_weight * n_D / (undesirable_weight * n_U)`` in [1, 4/3] (Ethayarajh et al.
    2024, eq. 8). ``model_path`` is also the reference: with ``use_lora`` the base with the adapter
    disabled. ``batch_size`` counts examples, at least 2: the KL estimate pairs each prompt with another
    example's completion of the same micro-batch.
    """

    method: ClassVar[str] = "kto"

    learning_rate: float = knob("kto", "learning_rate")
    max_length: int = knob("kto", "max_length")
    max_prompt_length: int | None = knob("kto", "max_prompt_length")
    beta: float = knob("kto", "beta")
    desirable_weight: float = knob("kto", "desirable_weight")
    undesirable_weight: float = knob("kto", "undesirable_weight")


@dataclass(frozen=True)
class KTOLoss:
    """The loop's loss function: summed KTO losses and metrics of a micro-batch (one unit per example).

    Rewards and log-probs are averaged over the desirable (``.../chosen``) or undesirable
    (``.../rejected``) examples of the step, and left out of a step that has none; ``kl`` is z₀.
    """

    beta: float
    desirable_weight: float
    undesirable_weight: float
    reference: Reference

    def __call__(self, model: torch.nn.Module, batch: UnpairedBatch) -> LossSums:
        n = batch.loss_denominator
        logps = policy_log_probs(model, batch)
        with torch.no_grad():  # z₀ is a reference point: no gradient through it
            kl_logps = policy_log_probs(model, batch.kl)
        # one reference pass over the training rows and the KL rows
        rows = SequenceRows(batch.input_ids, batch.attention_mask, batch.completion_mask)
        ref_logps = self.reference(stack_rows(rows, batch.kl))
        kl = (kl_logps - ref_logps[n:]).mean().clamp(min=0)
        logratios = logps - ref_logps[:n]
        good, bad = batch.labels, ~batch.labels
        chosen_losses, rejected_losses = kto_loss(
            logratios[good],
            logratios[bad],
            kl,
            beta=self.beta,
            desirable_weight=self.desirable_weight,
            undesirable_weight=self.undesirable_weight,
        )
        rewards = self.beta * logratios.detach()
        logps = logps.detach()
        n_good, n_bad = int(good.sum().item()), int(bad.sum().item())
        metrics = {
            "kl": kl.item() * (n_good + n_bad),
            "rewards/chosen": rewards[good].sum().item(),
            "rewards/rejected": rewards[bad].sum().item(),
            "logps/chosen": logps[good].sum().item(),
            "logps/rejected": logps[bad].sum().item(),
        }
        units = {"rewards/chosen": n_good, "logps/chosen": n_good, "rewards/rejected": n_bad}
        units["logps/rejected"] = n_bad
        return LossSums(
            loss=chosen_losses.sum() + rejected_losses.sum(),
            metrics={k: float(v) for k, v in metrics.items()},
            metric_units={k: float(v) for k, v in units.items()},
        )


def build_kto_task(
    config: KTOConfig,
    model: torch.nn.Module,
    tokenizer: Any,
    train: Sequence[UnpairedExample],
    valid: Sequence[UnpairedExample] | None = None,
    *,
    ref_model: torch.nn.Module | None = None,
) -> TrainingTask[UnpairedExample, UnpairedBatch]:
    """The loop's task for ``model``, with the reference chosen as for DPO (``trainers.methods.dpo``)."""
    if ref_model is not None:
        check_reference(model, ref_model)
    device = next(model.parameters()).device
    reference = pick_reference(model, ref_model, starting_model_loader(config, device))
    pad_id = tokenizer.pad_token_id
    assert isinstance(pad_id, int)
    collate = partial(collate_unpaired, pad_token_id=pad_id, max_length=config.max_length)
    loss = KTOLoss(config.beta, config.desirable_weight, config.undesirable_weight, reference)
    return TrainingTask(model, tokenizer, train, collate, loss, valid)


def train_kto(
    config: KTOConfig,
    train_rows: Rows,
    valid_rows: Rows | None = None,
    callbacks: TrainingCallbacks | None = None,
    *,
    rewards: RewardSet | None = None,
    ref_model: torch.nn.Module | None = None,
) -> TrainResult:
    """KTO-train ``config.model_path`` on labelled rows; raise ``DataError`` when the data is at fault.

    ``ref_model``: a reference other than the default (the starting model); it must not be the policy.
    """
    tokenizer, train, valid = begin_on_rows(
        config,
        tokenize_unpaired_rows,
        train_rows,
        valid_rows,
        rewards=rewards,
        max_length=config.max_length,
        max_prompt_length=config.max_prompt_length,
    )
    model = load_model_to_train(config, pick_device())
    task = build_kto_task(config, model, tokenizer, train, valid, ref_model=ref_model)
    return run_training(config, task, callbacks)
