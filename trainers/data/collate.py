"""Collate tokenized SFT examples into model inputs: right-padded, or packed into rows of ``max_length``
(``trainers.data.packing``: best-fit decreasing, ``position_ids`` restarting per example, no attention mask).

Packed examples never attend to one another provided the forward pass gets ``use_cache=False`` (with a
KV cache transformers skips the packed-sequence detection). tests/trainers/data/test_packing.py checks that
packed and padded batches give the same per-example losses. The first token of every example has no
target, so no loss crosses an example boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from trainers.data.packing import pack_layout
from trainers.data.sft import TokenizedExample
from trainers.kernels import varlen_attention
from trainers.losses.causal_lm import IGNORE_INDEX, target_positions


@dataclass(frozen=True)
class SFTBatch:
    input_ids: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T], unshifted, IGNORE_INDEX where no target
    attention_mask: torch.Tensor | None  # [B, T]; None when packed
    position_ids: torch.Tensor | None  # [B, T]; set when packed
    n_targets: int  # target tokens: the denominator of the loss
    n_inputs: int  # real (non-pad) input tokens, for throughput and `trained_tokens`
    # positions whose logits the loss reads (``losses.target_positions``), found here on the CPU so that
    # the training step does not wait on the device for them
    logit_positions: torch.Tensor
    # packed: the sequences' cumulative starts over the flattened rows and the longest, for the
    # variable-length attention kernel (``trainers.kernels.varlen_attention``); None when padded
    sequence_starts: torch.Tensor | None = None
    longest_sequence: int = 0
    # the model's inputs beyond ids and masks: a vision model's pixel values, its per-token types, ...
    # (``trainers.data.vision``); empty for text
    extra_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def loss_denominator(self) -> int:
        return self.n_targets

    @property
    def n_tokens(self) -> int:
        return self.n_inputs

    def to(self, device: torch.device) -> SFTBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return replace(
            self,
            input_ids=self.input_ids.to(device, non_blocking=True),
            labels=self.labels.to(device, non_blocking=True),
            attention_mask=move(self.attention_mask),
            position_ids=move(self.position_ids),
            logit_positions=self.logit_positions.to(device, non_blocking=True),
            sequence_starts=move(self.sequence_starts),
            extra_inputs={k: v.to(device, non_blocking=True) for k, v in self.extra_inputs.items()},
        )

    def attention_kwargs(self) -> dict[str, Any]:
        """The packed sequences' bounds as the decoder's keyword arguments, where this process's attention
        reads them (``varlen_attention.installed``); none when padded."""
        if self.sequence_starts is None or not varlen_attention.installed():
            return {}
        return varlen_attention.attention_kwargs(self.sequence_starts, self.longest_sequence)


def _labels(example: TokenizedExample) -> list[int]:
    labels = [
        tok if keep else IGNORE_INDEX for tok, keep in zip(example.input_ids, example.loss_mask, strict=True)
    ]
    labels[0] = IGNORE_INDEX
    return labels


def _padded(
    examples: Sequence[TokenizedExample], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, labels and attention_mask [B, T], right-padded to the longest example."""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(_labels(example))
        attention_mask[row, :n] = 1
    return input_ids, labels, attention_mask


def pad_batch(examples: Sequence[TokenizedExample], *, pad_token_id: int) -> SFTBatch:
    """Right-pad to the longest example."""
    input_ids, labels, attention_mask = _padded(examples, pad_token_id)
    return SFTBatch(
        input_ids=input_ids,
        labels=labels,
        attention_mask=attention_mask,
        position_ids=None,
        n_targets=sum(e.n_trainable for e in examples),
        n_inputs=int(attention_mask.sum().item()),
        logit_positions=target_positions(labels),
    )


class BatchInputs(Protocol):
    """Gives a batch's model inputs beyond ids and masks (``trainers.data.vision.VisionData``)."""

    def batch_inputs(self, examples: Sequence[TokenizedExample], width: int) -> dict[str, torch.Tensor]: ...


def pad_batch_with_inputs(
    examples: Sequence[TokenizedExample], *, pad_token_id: int, inputs: BatchInputs
) -> SFTBatch:
    """``pad_batch``, with the model's other inputs for its rows (a vision model's pixels)."""
    batch = pad_batch(examples, pad_token_id=pad_token_id)
    return replace(batch, extra_inputs=inputs.batch_inputs(examples, batch.input_ids.shape[1]))


def pack_batch(
    examples: Sequence[TokenizedExample], *, pad_token_id: int, max_length: int | None
) -> SFTBatch:
    """Bin into rows of at most ``max_length`` tokens (``trainers.data.packing``; None: the longest example's
    length, so no row is wider than padding would make it), right-padded to the longest row;
    ``position_ids`` restart at 0 for every example and for every row's padded tail."""
    input_ids, labels, _ = _padded(examples, pad_token_id)
    width = input_ids.shape[1]
    layout = pack_layout([len(e.input_ids) for e in examples], width, max_length or width)
    packed_labels = layout.pack(labels, fill=IGNORE_INDEX)
    starts, longest = varlen_attention.sequence_starts(layout.position_ids)
    return SFTBatch(
        input_ids=layout.pack(input_ids, fill=pad_token_id),
        labels=packed_labels,
        attention_mask=None,
        position_ids=layout.position_ids,
        n_targets=sum(e.n_trainable for e in examples),
        n_inputs=sum(len(e.input_ids) for e in examples),
        logit_positions=target_positions(packed_labels),
        sequence_starts=starts,
        longest_sequence=longest,
    )
