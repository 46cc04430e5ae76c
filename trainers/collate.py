"""Collate tokenized SFT examples into model inputs: right-padded, or packed without padding.

Packing concatenates the examples of a micro-batch into one row and restarts ``position_ids`` at 0 for
each example, with no attention mask. From such position ids transformers (>= 5) derives a
block-diagonal causal mask for the sdpa/eager/flex attention paths and ``cu_seqlens`` for
flash-attention, so packed examples never attend to one another -- provided the forward pass gets
``use_cache=False``, as with a KV cache transformers skips that detection. tests/trainers/test_packing.py
checks that packed and padded batches give the same per-example losses. The first token of every
example has no target, so no loss crosses an example boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from trainers.data import TokenizedExample
from trainers.losses import IGNORE_INDEX


@dataclass(frozen=True)
class SFTBatch:
    input_ids: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T], unshifted, IGNORE_INDEX where no target
    attention_mask: torch.Tensor | None  # [B, T]; None when packed
    position_ids: torch.Tensor | None  # [B, T]; set when packed
    n_targets: int  # target tokens: the denominator of the loss
    n_inputs: int  # real (non-pad) input tokens, for throughput and `trained_tokens`

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
        )


def _labels(example: TokenizedExample) -> list[int]:
    labels = [
        tok if keep else IGNORE_INDEX for tok, keep in zip(example.input_ids, example.loss_mask, strict=True)
    ]
    labels[0] = IGNORE_INDEX
    return labels


def pad_batch(examples: Sequence[TokenizedExample], *, pad_token_id: int) -> SFTBatch:
    """Right-pad to the longest example."""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(_labels(example))
        attention_mask[row, :n] = 1
    return SFTBatch(
        input_ids=input_ids,
        labels=labels,
        attention_mask=attention_mask,
        position_ids=None,
        n_targets=sum(e.n_trainable for e in examples),
        n_inputs=int(attention_mask.sum().item()),
    )


def pack_batch(examples: Sequence[TokenizedExample], *, pad_token_id: int) -> SFTBatch:
    """Concatenate into a single row [1, sum of lengths]; ``pad_token_id`` is unused (no padding)."""
    del pad_token_id
    input_ids = [tok for e in examples for tok in e.input_ids]
    labels = [lab for e in examples for lab in _labels(e)]
    position_ids = [pos for e in examples for pos in range(len(e.input_ids))]
    return SFTBatch(
        input_ids=torch.tensor([input_ids], dtype=torch.long),
        labels=torch.tensor([labels], dtype=torch.long),
        attention_mask=None,
        position_ids=torch.tensor([position_ids], dtype=torch.long),
        n_targets=sum(e.n_trainable for e in examples),
        n_inputs=len(input_ids),
    )
