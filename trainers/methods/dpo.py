"""Direct Preference Optimization (DPO): fit the policy to preference pairs, no reward model, no sampling.

    L(θ) = - E_(x, y_w, y_l) log σ(β log[π_θ(y_w|x) / π_ref(y_w|x)] - β log[π_θ(y_l|x) / π_ref(y_l|x)])

(Rafailov et al. 2023, eq. 7), with log π(y|x) the summed log-probability of the completion tokens; IPO
and hinge variants through ``loss_type``. The reference π_ref is the frozen starting model: for LoRA the
base with the adapter disabled (no second copy of the weights), for full fine-tuning a frozen copy, or
log-probs computed once before training (``precompute_ref_log_probs``). The loop is ``trainers.core.loop``.

    python -c "
    from trainers.methods.dpo import DPOConfig, train_dpo
    from trainers.modeling.tiny_model import build_tiny_model
    rows = [{'prompt': 'Is the sky blue?', 'chosen': ' Yes.', 'rejected': ' No.'}] * 16
    print(train_dpo(DPOConfig(str(build_tiny_model('/tmp/tiny')), '/tmp/dpo-out', max_steps=10), rows))"
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from trainers.core.callbacks import TrainingCallbacks, TrainResult
from trainers.core.config import VisionConfig, knob
from trainers.core.loop import LossSums, TrainingTask, run_training
from trainers.core.precision import autocast_dtype
from trainers.data.example_store import ExampleStore, ExampleWriter
from trainers.data.packing import PairPacking
from trainers.data.preference import (
    PreferenceBatch,
    PreferenceExample,
    collate_preferences,
    tokenize_preference_rows,
)
from trainers.data.vision import VisionData
from trainers.families.entry import Rows, begin_on_rows, load_model_to_train, load_vision_data
from trainers.families.reference import (
    Reference,
    check_reference,
    pick_reference,
    policy_log_probs,
    starting_model_loader,
)
from trainers.families.reference_cache import ReferenceCache, reference_key
from trainers.losses.preference import dpo_loss
from trainers.modeling.loading import (
    pair_packing,
    pick_device,
)
from trainers.registry import choices

if TYPE_CHECKING:
    from trainers.rewards.reward_set import RewardSet

LOSS_TYPES = choices("dpo", "loss_type")


@dataclass
class DPOConfig(VisionConfig):
    """Configuration of a DPO run: ``TrainingConfig``'s fields plus the ``dpo`` entry's own hyperparameters
    (``trainers.registry``; docs/methods.md lists them with their docs and ranges), read as follows.

    A pair left with no chosen or no rejected token after truncation is dropped. ``beta`` is IPO's τ for
    ``loss_type="ipo"`` (Azar et al. 2023, on per-token mean log-ratios, as TRL and the IPO authors do);
    ``hinge`` is SLiC's (Zhao et al. 2023); ``label_smoothing`` applies to ``sigmoid`` only.
    ``model_path`` is also the reference: with ``use_lora`` the base with the adapter disabled.
    ``batch_size`` counts pairs, so the forward pass sees 2 * batch_size sequences.

    Run (set by the worker, not a hyperparameter):
        reference_cache_file: where the training pairs' precomputed reference log-probs are kept between
            runs (``trainers.families.reference_cache``; next to the training file): a later run on the
            same pairs and reference reads them instead of scoring the pairs again. None: not kept.
    """

    method: ClassVar[str] = "dpo"

    learning_rate: float = knob("dpo", "learning_rate")
    max_length: int = knob("dpo", "max_length")
    max_prompt_length: int | None = knob("dpo", "max_prompt_length")
    beta: float = knob("dpo", "beta")
    loss_type: str = knob("dpo", "loss_type")
    label_smoothing: float = knob("dpo", "label_smoothing")
    precompute_ref_log_probs: bool = knob("dpo", "precompute_ref_log_probs")
    reference_cache_file: str | None = None


# -- pure functions -----------------------------------------------------------------------------------


# -- the method ---------------------------------------------------------------------------------------


@dataclass
class DPOLoss:
    """The loop's loss function: summed DPO losses and metrics of a micro-batch (one unit per pair)."""

    beta: float
    loss_type: str
    label_smoothing: float
    reference: Reference | None  # None: the batch carries precomputed reference log-probs

    def __call__(self, model: torch.nn.Module, batch: PreferenceBatch) -> LossSums:
        n = batch.n_pairs
        logps = policy_log_probs(model, batch)
        chosen, rejected = logps[:n], logps[n:]
        if batch.ref_chosen_logps is not None and batch.ref_rejected_logps is not None:
            ref_chosen, ref_rejected = batch.ref_chosen_logps, batch.ref_rejected_logps
        elif self.reference is not None:
            ref_logps = self.reference(batch)
            ref_chosen, ref_rejected = ref_logps[:n], ref_logps[n:]
        else:
            raise ValueError("the batch carries no precomputed reference log-probs and there is no reference")
        lengths = batch.completion_mask[:, 1:].sum(dim=1).float()
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            beta=self.beta,
            loss_type=self.loss_type,
            label_smoothing=self.label_smoothing,
            chosen_lengths=lengths[:n],
            rejected_lengths=lengths[n:],
        )
        chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
        metrics = {  # tensors: the loop reads them once per step, not once per micro-batch
            "rewards/chosen": chosen_rewards.sum(),
            "rewards/rejected": rejected_rewards.sum(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).sum().float(),
            "rewards/margins": (chosen_rewards - rejected_rewards).sum(),
            "logps/chosen": chosen.detach().sum(),
            "logps/rejected": rejected.detach().sum(),
        }
        return LossSums(loss=losses.sum(), metrics=metrics)


@dataclass(frozen=True)
class Scoring:
    """How the reference scores the pairs before training."""

    batch_size: int  # changes the values by the precision's rounding only: not in a kept entry's key
    pad_token_id: int
    device: torch.device
    compute_dtype: torch.dtype | None
    pack: PairPacking
    vision: VisionData | None = None  # a vision model's processor: the pairs' pixels

    def key_settings(self) -> str:
        """What of this a kept entry's key holds (``reference_cache.reference_key``'s ``settings``)."""
        return f"autocast={self.compute_dtype}|device={self.device.type}|pack={self.pack.value}"


@torch.no_grad()
def precompute_reference_log_probs(
    reference: Reference, examples: Sequence[PreferenceExample], scoring: Scoring
) -> ExampleStore[PreferenceExample]:
    """``examples`` with their reference log-probs attached, computed ``scoring.batch_size`` pairs at a
    time."""
    out = ExampleWriter(PreferenceExample)
    dtype, device = scoring.compute_dtype, scoring.device
    ctx = partial(torch.autocast, device.type, dtype=dtype) if dtype else nullcontext
    for start in range(0, len(examples), scoring.batch_size):
        chunk = examples[start : start + scoring.batch_size]
        batch = collate_preferences(
            chunk, pad_token_id=scoring.pad_token_id, pack=scoring.pack, inputs=scoring.vision
        ).to(device)
        with ctx():
            logps = reference(batch)
        chosen, rejected = logps[: len(chunk)], logps[len(chunk) :]
        for e, c, r in zip(chunk, chosen.tolist(), rejected.tolist(), strict=True):
            out.append(e.with_ref_logps(c, r))
    return out.finish()


def scoring_message(n_pairs: int) -> str:
    """What a run says before its reference scores the training pairs: a pass before the first step that
    a large file makes long, with nothing else to watch meanwhile."""
    return f"Computing the reference log-probs of {n_pairs} pairs before training (precompute_ref_log_probs)"


def kept_reference_log_probs(
    reference: Reference,
    examples: Sequence[PreferenceExample],
    cache: ReferenceCache,
    scoring: Scoring,
    *,
    notify: Callable[[str], None],
) -> ExampleStore[PreferenceExample]:
    """``precompute_reference_log_probs``, read from ``cache`` when an earlier run stored them for the
    same pairs and reference, else computed and stored there."""
    settings = scoring.key_settings()
    key = reference_key(reference.tensors(), reference.config(), examples, settings=settings)
    values = cache.load(key, len(examples))
    if values is not None:
        out = ExampleWriter(PreferenceExample)
        for e, (chosen, rejected) in zip(examples, values.tolist(), strict=True):
            out.append(e.with_ref_logps(chosen, rejected))
        notify(f"Reference log-probs of {len(examples)} pairs reused from an earlier run on the same pairs")
        return out.finish()
    notify(scoring_message(len(examples)))
    scored = precompute_reference_log_probs(reference, examples, scoring)
    cache.save(key, np.array([[e.ref_chosen_logp, e.ref_rejected_logp] for e in scored], dtype=np.float64))
    return scored


def build_dpo_task(
    config: DPOConfig,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    train: Sequence[PreferenceExample],
    valid: Sequence[PreferenceExample] | None = None,
    *,
    ref_model: torch.nn.Module | None = None,
    load_reference: Callable[[], torch.nn.Module] | None = None,
    notify: Callable[[str], None] | None = None,
    vision: VisionData | None = None,
) -> TrainingTask[PreferenceExample, PreferenceBatch]:
    """The loop's task for ``model``: picks the reference, precomputes its log-probs if asked (the
    training pairs' through ``config.reference_cache_file``, when set; ``notify`` hears of the pass
    before it starts, or of its reuse).

    ``ref_model`` None: the adapter-disabled base of a LoRA ``model``; for a full model a frozen copy,
    made by ``load_reference`` if given (a resumed run's model is no longer the reference) or else by
    deep-copying ``model`` as it is now.
    """
    if ref_model is not None:
        check_reference(model, ref_model)
    pad_id = tokenizer.pad_token_id
    assert isinstance(pad_id, int)
    device = next(model.parameters()).device
    reference = pick_reference(model, ref_model, load_reference, precompute=config.precompute_ref_log_probs)
    if config.precompute_ref_log_probs:
        scoring = Scoring(
            batch_size=config.batch_size,
            pad_token_id=pad_id,
            device=device,
            compute_dtype=autocast_dtype(config.mixed_precision, device),
            pack=pair_packing(model),
            vision=vision,
        )
        was_training = model.training
        model.eval()  # no dropout in the reference
        say = notify or (lambda _message: None)
        if config.reference_cache_file:
            cache = ReferenceCache(Path(config.reference_cache_file))
            train = kept_reference_log_probs(reference, train, cache, scoring, notify=say)
        else:
            say(scoring_message(len(train)))
            train = precompute_reference_log_probs(reference, train, scoring)
        valid = precompute_reference_log_probs(reference, valid, scoring) if valid else valid
        model.train(was_training)
        del reference  # a copy made for precomputing is freed here: the loss keeps no reference
        gc.collect()
        loss = DPOLoss(config.beta, config.loss_type, config.label_smoothing, None)
    else:
        loss = DPOLoss(config.beta, config.loss_type, config.label_smoothing, reference)
    collate = partial(collate_preferences, pad_token_id=pad_id, pack=pair_packing(model), inputs=vision)
    saved = vision.processor if vision is not None else tokenizer  # what checkpoints hold beside the weights
    return TrainingTask(model, saved, train, collate, loss, valid)


def train_dpo(
    config: DPOConfig,
    train_rows: Rows,
    valid_rows: Rows | None = None,
    callbacks: TrainingCallbacks | None = None,
    *,
    rewards: RewardSet | None = None,
    ref_model: torch.nn.Module | None = None,
) -> TrainResult:
    """DPO-train ``config.model_path`` on preference rows; raise ``DataError`` when the data is at fault.

    ``ref_model``: a reference other than the default (the starting model); it must not be the policy.
    """
    vision = load_vision_data(config)
    tokenizer, train, valid = begin_on_rows(
        config,
        tokenize_preference_rows,
        train_rows,
        valid_rows,
        rewards=rewards,
        max_length=config.max_length,
        max_prompt_length=config.max_prompt_length,
        vision=vision,
    )
    device = pick_device()
    model = load_model_to_train(config, device)
    load_reference = starting_model_loader(config, device)
    task = build_dpo_task(
        config,
        model,
        tokenizer,
        train,
        valid,
        ref_model=ref_model,
        load_reference=load_reference,
        notify=callbacks.on_message if callbacks is not None else None,
        vision=vision,
    )
    return run_training(config, task, callbacks)
