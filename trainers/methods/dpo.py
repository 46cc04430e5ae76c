"""Direct Preference Optimization (DPO): fit the policy to preference pairs, no reward model, no sampling.

    L(θ) = - E_(x, y_w, y_l) log σ(β log[π_θ(y_w|x) / π_ref(y_w|x)] - β log[π_θ(y_l|x) / π_ref(y_l|x)])

(Rafailov et al. 2023, eq. 7), with log π(y|x) the summed log-probability of the completion tokens; IPO
and hinge variants through ``loss_type``. The reference π_ref is the frozen starting model: for LoRA the
base with the adapter disabled (no second copy of the weights), for full fine-tuning a frozen copy, or
log-probs computed once before training (``precompute_ref_log_probs``). The loop is ``trainers.core.loop``.

    python -c "
    from trainers.methods.dpo import DPOConfig, train_dpo; from trainers.modeling.tiny_model import build_tiny_model
    rows = [{'prompt': 'Is the sky blue?', 'chosen': ' Yes.', 'rejected': ' No.'}] * 16
    print(train_dpo(DPOConfig(str(build_tiny_model('/tmp/tiny')), '/tmp/dpo-out', max_steps=10), rows))"
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import PreTrainedTokenizerBase

from trainers.core.callbacks import TrainingCallbacks, TrainResult
from trainers.core.config import TrainingConfig
from trainers.core.loop import LossSums, TrainingTask, run_training
from trainers.core.precision import autocast_dtype
from trainers.data.example_store import ExampleStore, ExampleWriter
from trainers.data.packing import PackedLayout, PairPacking
from trainers.data.preference import (
    PreferenceBatch,
    PreferenceExample,
    collate_preferences,
    tokenize_preference_rows,
)
from trainers.families.entry import Rows, begin_training, tokenize_splits
from trainers.families.reference_cache import ReferenceCache, reference_key
from trainers.modeling.loading import (
    load_model,
    pair_packing,
    pick_device,
    row_sums,
    target_log_probs,
)
from trainers.registry import choices

if TYPE_CHECKING:
    from trainers.families.rl import RewardSet

LOSS_TYPES = choices("dpo", "loss_type")


@dataclass
class DPOConfig(TrainingConfig):
    """Configuration of a DPO run: the shared fields of ``trainers.core.config.TrainingConfig``, plus

    Data:
        max_length: prompt + completion is truncated to this many tokens; a pair left with no chosen or
            no rejected token is dropped.
        max_prompt_length: the prompt is first cut to its last this many tokens (None: not cut).

    Method:
        beta: β, the strength of the implicit KL penalty towards the reference (IPO's τ).
        loss_type: ``sigmoid`` (DPO), ``ipo`` (Azar et al. 2023, on per-token mean log-ratios, as TRL and
            the IPO authors do) or ``hinge`` (SLiC, Zhao et al. 2023).
        label_smoothing: ε of conservative DPO for ``sigmoid``: the label is assumed flipped with
            probability ε (0: plain DPO).
        precompute_ref_log_probs: compute the reference log-probs of every pair once before training,
            then keep no reference model in memory.

    Run:
        reference_cache_file: where the training pairs' precomputed reference log-probs are kept between
            runs (``trainers.families.reference_cache``; set by the worker, next to the training file): a later
            run on the same pairs and reference reads them instead of scoring the pairs again. None:
            not kept.

    Shared fields as DPO reads them: ``model_path`` is also the reference; with ``use_lora`` the
    reference is the base with the adapter disabled. ``n_epochs`` passes over the training pairs;
    ``batch_size`` counts pairs, so the forward pass sees 2 * batch_size sequences.
    """

    method: ClassVar[str] = "dpo"

    learning_rate: float = 5e-5
    max_length: int = 1024
    max_prompt_length: int | None = None
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    precompute_ref_log_probs: bool = False
    reference_cache_file: str | None = None


# -- pure functions -----------------------------------------------------------------------------------


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair preference losses and implicit rewards.

    All inputs are [B] summed completion log-probs, log π(y|x); returns (losses, chosen_rewards,
    rejected_rewards), each [B], the rewards β·(log π_θ(y|x) - log π_ref(y|x)) detached. With
    h = (log π_θ(y_w) - log π_ref(y_w)) - (log π_θ(y_l) - log π_ref(y_l)):

    - ``sigmoid``: -log σ(β h), DPO (Rafailov et al. 2023, eq. 7); with label smoothing ε,
      -(1-ε) log σ(β h) - ε log σ(-β h), conservative DPO (Mitchell 2023).
    - ``ipo``: (h - 1/(2β))², IPO (Azar et al. 2023, eq. 17, β = τ). Given ``chosen_lengths`` and
      ``rejected_lengths`` ([B] completion token counts) each log-ratio is divided by its length first,
      the normalisation the IPO authors used for the paper's results (and TRL does).
    - ``hinge``: max(0, 1 - β h), SLiC-HF (Zhao et al. 2023, eq. 1 with δ = 1/β).
    """
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    if loss_type == "sigmoid":
        h = chosen_logratios - rejected_logratios
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        if chosen_lengths is not None and rejected_lengths is not None:
            h = chosen_logratios / chosen_lengths.clamp(min=1) - rejected_logratios / rejected_lengths.clamp(
                min=1
            )
        else:
            h = chosen_logratios - rejected_logratios
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * (chosen_logratios - rejected_logratios))
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, not {loss_type!r}")
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


# -- the method ---------------------------------------------------------------------------------------


class CompletionRows(Protocol):
    """Right-padded prompt + completion rows (a ``PreferenceBatch``, KTO's rows, ...)."""

    @property
    def input_ids(self) -> torch.Tensor: ...  # [N, T]

    @property
    def attention_mask(self) -> torch.Tensor: ...  # [N, T]

    @property
    def completion_mask(self) -> torch.Tensor: ...  # [N, T] bool

    @property
    def packed(self) -> PackedLayout | None: ...  # where the decoder may run them packed


def policy_log_probs(model: torch.nn.Module, batch: CompletionRows) -> torch.Tensor:
    """[N] summed completion log-probs of the rows (a preference batch: chosen then rejected), in one
    forward pass."""
    token_logps = target_log_probs(
        model, batch.input_ids, batch.attention_mask, batch.completion_mask, packed=batch.packed
    )
    return row_sums(token_logps, batch.completion_mask)


@dataclass(frozen=True)
class Reference:
    """The reference policy's forward: rows -> their [N] completion log-probs, without gradients.

    ``model`` is a separate frozen model, or (``disable_adapter``) the LoRA policy itself run with its
    adapter switched off: the base weights, shared, never copied.
    """

    model: torch.nn.Module
    disable_adapter: bool = False

    @classmethod
    def frozen(cls, model: torch.nn.Module) -> Reference:
        model.eval().requires_grad_(False)
        return cls(model)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The named weights and buffers the reference computes with: with ``disable_adapter``, the base
        model's own (not the adapter's, nor the trainable copies of ``modules_to_save``)."""
        if self.disable_adapter:
            assert isinstance(self.model, PeftModel)
            base = self.model.get_base_model()
            for name, tensor in chain(base.named_parameters(), base.named_buffers()):
                if "lora_" not in name and ".modules_to_save." not in name:
                    yield name, tensor
        else:
            yield from chain(self.model.named_parameters(), self.model.named_buffers())

    def config(self) -> dict[str, object]:
        model = self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model
        config = getattr(model, "config", None)
        return config.to_dict() if config is not None else {}

    @torch.no_grad()
    def __call__(self, batch: CompletionRows) -> torch.Tensor:
        if self.disable_adapter:
            assert isinstance(self.model, PeftModel)
            with self.model.disable_adapter():
                return policy_log_probs(self.model, batch)
        return policy_log_probs(self.model, batch)


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


def check_reference(model: torch.nn.Module, ref_model: torch.nn.Module) -> None:
    """Refuse a reference that is, or shares weights with, the policy: it would move with training."""
    policy = {p.data_ptr() for p in model.parameters()}
    if ref_model is model or any(p.data_ptr() in policy for p in ref_model.parameters()):
        raise ValueError(
            "ref_model is the policy model (or shares its weights), so the reference would change during "
            "training. Pass ref_model=None to get the right reference automatically (the adapter-disabled "
            "base for LoRA, a frozen copy for full fine-tuning), or pass a separate copy, e.g. "
            "copy.deepcopy(model) taken before training."
        )


@dataclass(frozen=True)
class Scoring:
    """How the reference scores the pairs before training."""

    batch_size: int  # changes the values by the precision's rounding only: not in a kept entry's key
    pad_token_id: int
    device: torch.device
    compute_dtype: torch.dtype | None
    pack: PairPacking

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
        batch = collate_preferences(chunk, pad_token_id=scoring.pad_token_id, pack=scoring.pack).to(device)
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
    collate = partial(collate_preferences, pad_token_id=pad_id, pack=pair_packing(model))
    return TrainingTask(model, tokenizer, train, collate, loss, valid)


def pick_reference(
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    load_reference: Callable[[], torch.nn.Module] | None,
    *,
    precompute: bool = False,
) -> Reference:
    """``ref_model`` frozen if given; else the adapter-disabled ``model`` (LoRA), else a frozen copy of the
    starting model (``load_reference``'s, or ``model`` deep-copied); with ``precompute`` and no loader,
    ``model`` itself (it has not trained yet)."""
    if ref_model is not None:
        device = next(model.parameters()).device
        return Reference.frozen(torch.nn.Module.to(ref_model, device))
    if isinstance(model, PeftModel):
        return Reference(model, disable_adapter=True)
    if precompute and load_reference is None:
        return Reference(model)  # the model has not trained yet: it is the reference, no copy needed
    return Reference.frozen(load_reference() if load_reference is not None else copy.deepcopy(model))


def starting_model_loader(
    config: TrainingConfig, device: torch.device
) -> Callable[[], torch.nn.Module] | None:
    """For a resumed full fine-tune, a loader of the starting model (the reference): the resumed model holds
    trained weights. None otherwise (a LoRA reference is the adapter-disabled base; a fresh model is the
    starting one)."""
    if not config.resume_from or config.use_lora:
        return None
    return partial(load_model, replace(config, resume_from=None, gradient_checkpointing=False), device)


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
    tokenizer = begin_training(config, valid_rows=valid_rows, rewards=rewards)
    tokenize = partial(
        tokenize_preference_rows,
        tokenizer=tokenizer,
        max_length=config.max_length,
        max_prompt_length=config.max_prompt_length,
    )
    train, valid = tokenize_splits(tokenize, train_rows, valid_rows)
    device = pick_device()
    model = load_model(config, device)
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
    )
    return run_training(config, task, callbacks)
