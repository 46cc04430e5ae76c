"""Collate tokenized SFT examples into model inputs: right-padded, or packed into rows of ``max_length``.

Packing bins the examples of a micro-batch into as few rows of at most ``max_length`` tokens as
best-fit decreasing finds (longest example first, each into the fullest row it still fits), pads the rows
to the longest one and restarts ``position_ids`` at 0 for each example -- and for each row's padded tail,
which so becomes a sequence of its own that no example sees -- with no attention mask. From such
position ids transformers (>= 5) derives a block-diagonal causal mask for the sdpa/eager/flex attention
paths and ``cu_seqlens`` for flash-attention, so packed examples never attend to one another, provided
the forward pass gets ``use_cache=False`` (with a KV cache transformers skips that detection).
tests/trainers/test_packing.py checks that packed and padded batches give the same per-example losses.
The first token of every example has no target, so no loss crosses an example boundary.

Rows of ``max_length`` rather than one row per micro-batch: attention costs the square of a row's
length, so a single row of the whole micro-batch (what packing did first) is slower than padding; rows
of ``max_length`` waste almost no token slots on padding and keep attention at ``max_length``'s square.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from trainers.data import TokenizedExample
from trainers.losses import IGNORE_INDEX, target_positions


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
        logit_positions=target_positions(labels),
    )


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of total at most ``capacity`` (an item longer than
    ``capacity`` gets a bin of its own): longest first, each into the fullest bin it still fits."""
    bins: list[list[int]] = []
    free: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in range(len(bins)) if free[b] >= lengths[index]]
        if fits:
            best = min(fits, key=lambda b: free[b])
            bins[best].append(index)
            free[best] -= lengths[index]
        else:
            bins.append([index])
            free.append(capacity - lengths[index])
    return bins


def pack_batch(examples: Sequence[TokenizedExample], *, pad_token_id: int, max_length: int) -> SFTBatch:
    """Bin into rows of at most ``max_length`` tokens (best-fit decreasing), right-padded to the longest
    row; ``position_ids`` restart at 0 for every example and for every row's padded tail."""
    bins = best_fit_decreasing([len(e.input_ids) for e in examples], max_length)
    width = max(sum(len(examples[i].input_ids) for i in row) for row in bins)
    input_ids = torch.full((len(bins), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(bins), width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(bins), width), dtype=torch.long)
    for row, members in enumerate(bins):
        start = 0
        for index in members:
            example = examples[index]
            end = start + len(example.input_ids)
            input_ids[row, start:end] = torch.tensor(example.input_ids)
            labels[row, start:end] = torch.tensor(_labels(example))
            position_ids[row, start:end] = torch.arange(end - start)
            start = end
        position_ids[row, start:] = torch.arange(width - start)  # the padded tail: a sequence of its own
    return SFTBatch(
        input_ids=input_ids,
        labels=labels,
        attention_mask=None,
        position_ids=position_ids,
        n_targets=sum(e.n_trainable for e in examples),
        n_inputs=sum(len(e.input_ids) for e in examples),
        logit_positions=target_positions(labels),
    )
