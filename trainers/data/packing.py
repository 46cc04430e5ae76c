"""Packing: the real tokens of right-padded rows, binned into as few rows of at most ``capacity`` tokens as
best-fit decreasing finds, with ``position_ids`` that restart at 0 for every sequence.

From such position ids (and no attention mask, no KV cache) transformers (>= 5) derives a block-diagonal
causal mask for the sdpa/eager/flex attention paths and ``cu_seqlens`` for flash-attention, so packed
sequences never attend to one another: each gets the hidden states it has alone. A packed row's padded
tail restarts its positions too, so it is a sequence of its own that no real token sees.

Why: a micro-batch padded to its longest row spends compute on every pad slot; packed, the decoder runs
on (almost) only real tokens. Rows of ``capacity`` rather than one row per micro-batch because
attention costs the square of a row's length (one row of the whole micro-batch was 2× slower than
padding on SmolLM2, issue 9).

SFT packs its examples into the model's input (``trainers.data.collate.pack_batch``); the preference methods
keep their right-padded [N, T] batch and pack only the decoder's input and output
(``PackedLayout.pack`` / ``unpack``), so every loss reads its usual [N, T] layout.

A preference pair's two rows begin with the same prompt, and so do an online method's completions of one
prompt. ``shared_prompt_layout`` runs such a prompt once: the prompt, then each of its completions in a
row, every completion's positions continuing from the prompt, and an explicit attention mask (position
ids cannot say "see the prompt but not the other completions") that lets each completion see the prompt
and itself only. All the group's rows map their prompt slots to the same packed slots, so unpacking hands
each row the prompt's hidden states, and backward sums the rows' gradients there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch


class PairPacking(StrEnum):
    """How a preference batch's 2B rows run through the decoder."""

    PADDED = "padded"  # as right-padded rows, with their attention mask
    SEQUENCES = "sequences"  # each row a sequence of its own, packed (``pack_layout``)
    # each pair's prompt once, then both completions (``shared_prompt_layout``)
    SHARED_PROMPTS = "shared_prompts"


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


@dataclass(frozen=True)
class PackedLayout:
    """Where each slot of right-padded rows [N, T] goes in packed rows [R, W]."""

    padded_shape: tuple[int, int]  # (N, T)
    # [N * T] long: the flat packed slot (< R * W) of each real token; R * W (one past the end) for a pad
    slot_of: torch.Tensor
    position_ids: torch.Tensor  # [R, W]
    # [R, 1, W, W] bool, True where a slot (dim 2) attends to one (dim 3); None: transformers derives
    # per-sequence causal attention from the position ids
    attention: torch.Tensor | None = None

    @property
    def packed_shape(self) -> tuple[int, int]:
        rows, width = self.position_ids.shape
        return rows, width

    def pack(self, padded: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """[N, T] -> [R, W]; the packed rows' pad slots hold ``fill``."""
        rows, width = self.packed_shape
        flat = padded.new_full((rows * width + 1,), fill)  # the extra slot takes every pad
        flat[self.slot_of] = padded.flatten()
        return flat[:-1].view(rows, width)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[R, W, *] -> [N, T, *], zeros at the pad slots; differentiable (a gather)."""
        return self.take(packed, self.slot_of).view(*self.padded_shape, *packed.shape[2:])

    def take(self, packed: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The values of packed rows [R, W, *] at the flat packed ``slots`` (a tensor of any shape; R * W,
        one past the end, gives zeros); differentiable (a gather)."""
        flat = packed.flatten(0, 1)
        flat = torch.cat([flat, flat.new_zeros((1, *flat.shape[1:]))])
        return flat[slots]

    def attention_mask(self) -> torch.Tensor | None:
        """``attention`` as the decoder gets it. On the CPU an additive float mask (0 where a slot attends,
        float32's minimum elsewhere), which sdpa's CPU kernel takes as it is: a boolean mask it converts
        to a new float copy in every layer, and keeps each copy for backward (30 of them for SmolLM2).
        Elsewhere the boolean mask: under CUDA autocast a float32 mask would not match bf16 queries."""
        if self.attention is None or self.attention.device.type != "cpu":
            return self.attention
        blocked = torch.finfo(torch.float32).min
        return torch.zeros(self.attention.shape).masked_fill_(~self.attention, blocked)

    def to(self, device: torch.device) -> PackedLayout:
        return PackedLayout(
            self.padded_shape,
            self.slot_of.to(device, non_blocking=True),
            self.position_ids.to(device, non_blocking=True),
            None if self.attention is None else self.attention.to(device, non_blocking=True),
        )


def pack_layout(lengths: Sequence[int], width: int, capacity: int) -> PackedLayout:
    """The layout of right-padded rows of ``lengths`` real tokens (padded to ``width``) packed into rows of
    at most ``capacity`` tokens by best-fit decreasing, the packed rows padded to the longest."""
    if not lengths or min(lengths) < 1 or max(lengths) > width:
        raise ValueError(f"every row needs 1 to {width} tokens, got lengths {list(lengths)}")
    bins = best_fit_decreasing(lengths, capacity)
    packed_width = max(sum(lengths[i] for i in members) for members in bins)
    slot_of = torch.full((len(lengths) * width,), len(bins) * packed_width, dtype=torch.long)
    position_ids = torch.zeros((len(bins), packed_width), dtype=torch.long)
    for row, members in enumerate(bins):
        start = 0
        for index in members:
            n = lengths[index]
            first = row * packed_width + start
            slot_of[index * width : index * width + n] = torch.arange(first, first + n)
            position_ids[row, start : start + n] = torch.arange(n)
            start += n
        position_ids[row, start:] = torch.arange(packed_width - start)  # the padded tail: its own sequence
    return PackedLayout((len(lengths), width), slot_of, position_ids)


def shared_prompt_layout(
    prompts: Sequence[int], completions: Sequence[Sequence[int]], rows: Sequence[Sequence[int]], width: int
) -> PackedLayout:
    """The layout of right-padded rows (a prompt, then a completion, padded to ``width``) in groups that
    begin with the same prompt, with each group's prompt run once: group i is its prompt of ``prompts[i]``
    tokens, then its completions of ``completions[i]`` tokens, which belong to the padded rows ``rows[i]``.
    Groups are binned by best-fit decreasing into rows of at most max(``width``, largest group) tokens.

    A completion's positions continue from its prompt, and ``attention`` lets it see its prompt and itself
    only, so every padded row's hidden states are those it has alone. A completion may be empty: its row
    is then the prompt alone."""
    n_rows = sum(len(group) for group in completions)
    lengths = [p + c for p, group in zip(prompts, completions, strict=True) for c in group]
    placed = sorted(row for group in rows for row in group)
    if (
        min(prompts, default=0) < 1
        or min(lengths) < 1
        or max(lengths) > width
        or placed != list(range(n_rows))
    ):
        raise ValueError(
            f"every group needs a prompt token, each row at most {width} tokens, each row in one group"
        )
    units = [p + sum(group) for p, group in zip(prompts, completions, strict=True)]
    bins = best_fit_decreasing(units, max(width, *units))
    packed_width = max(sum(units[i] for i in members) for members in bins)
    slot_of = torch.full((n_rows * width,), len(bins) * packed_width, dtype=torch.long)
    position_ids = torch.zeros((len(bins), packed_width), dtype=torch.long)
    attention = torch.zeros((len(bins), 1, packed_width, packed_width), dtype=torch.bool)
    causal = torch.ones((packed_width, packed_width), dtype=torch.bool).tril()
    for packed_row, members in enumerate(bins):
        start = 0
        for i in members:
            p, first = prompts[i], packed_row * packed_width + start
            position_ids[packed_row, start : start + p] = torch.arange(p)
            attention[packed_row, 0, start : start + p, start : start + p] = causal[:p, :p]
            at = start + p  # where the next completion begins in the packed row
            for c, row in zip(completions[i], rows[i], strict=True):
                slot_of[row * width : row * width + p] = torch.arange(first, first + p)  # the same slots
                slot_of[row * width + p : row * width + p + c] = torch.arange(
                    packed_row * packed_width + at, packed_row * packed_width + at + c
                )
                position_ids[packed_row, at : at + c] = torch.arange(p, p + c)
                attention[packed_row, 0, at : at + c, start : start + p] = True  # its prompt
                attention[packed_row, 0, at : at + c, at : at + c] = causal[:c, :c]  # and itself
                at += c
            start = at
        # the padded tail: a sequence of its own, so that no attention row is empty
        position_ids[packed_row, start:] = torch.arange(packed_width - start)
        attention[packed_row, 0, start:, start:] = causal[: packed_width - start, : packed_width - start]
    return PackedLayout((n_rows, width), slot_of, position_ids, attention)
