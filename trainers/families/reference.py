"""The reference policy of the preference methods (DPO, KTO, ...): a frozen model, or the LoRA policy
with its adapter switched off, scoring completion rows without gradients; and which one a run gets."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from itertools import chain
from typing import Protocol

import torch
from peft import PeftModel

from trainers.core.config import TrainingConfig
from trainers.data.packing import PackedLayout
from trainers.families.entry import load_model_to_train
from trainers.modeling.loading import row_sums, target_log_probs


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

    @property
    def extra_inputs(self) -> dict[str, torch.Tensor]: ...  # a vision model's pixels; empty for text


def policy_log_probs(model: torch.nn.Module, batch: CompletionRows) -> torch.Tensor:
    """[N] summed completion log-probs of the rows (a preference batch: chosen then rejected), in one
    forward pass."""
    token_logps = target_log_probs(
        model,
        batch.input_ids,
        batch.attention_mask,
        batch.completion_mask,
        packed=batch.packed,
        extra_inputs=batch.extra_inputs,
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
    return partial(
        load_model_to_train, replace(config, resume_from=None, gradient_checkpointing=False), device
    )
