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

SFT packs its examples into the model's input (``trainers.collate.pack_batch``); the preference methods
keep their right-padded [N, T] batch and pack only the decoder's input and output
(``PackedLayout.pack`` / ``unpack``), so every loss reads its usual [N, T] layout.

A preference pair's two rows begin with the same prompt. ``shared_prompt_layout`` runs that prompt once:
prompt, chosen, rejected in a row, the rejected tokens' positions continuing from the prompt, and an
explicit attention mask (position ids cannot say "see the prompt but not the chosen tokens") that lets
each completion see the prompt and itself only. Both rows' prompt slots map to the same packed slots, so
unpacking hands each row the prompt's hidden states, and backward sums the two rows' gradients there.
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
        flat = packed.flatten(0, 1)
        flat = torch.cat([flat, flat.new_zeros((1, *flat.shape[1:]))])
        return flat[self.slot_of].view(*self.padded_shape, *packed.shape[2:])

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
    prompts: Sequence[int], chosen: Sequence[int], rejected: Sequence[int], width: int
) -> PackedLayout:
    """The layout of a preference batch's 2B right-padded rows (B of prompt + chosen, then B of the same
    prompts + rejected, padded to ``width``) with each pair's prompt run once: prompt, chosen, rejected in
    a row, binned by best-fit decreasing into rows of at most max(``width``, longest pair) tokens.

    The rejected tokens' positions continue from the prompt, and ``attention`` lets each completion see
    its prompt and itself only, so every row's hidden states are those it has alone."""
    lengths = [p + c for p, c in zip(prompts, chosen, strict=True)]
    lengths += [p + r for p, r in zip(prompts, rejected, strict=True)]
    if min(prompts, default=0) < 1 or min(chosen) < 1 or min(rejected) < 1 or max(lengths) > width:
        raise ValueError(
            f"every pair needs a prompt token and a completion token on each side, each row at most {width}"
        )
    n = len(prompts)
    units = [p + c + r for p, c, r in zip(prompts, chosen, rejected, strict=True)]
    bins = best_fit_decreasing(units, max(width, *units))
    packed_width = max(sum(units[i] for i in members) for members in bins)
    slot_of = torch.full((2 * n * width,), len(bins) * packed_width, dtype=torch.long)
    position_ids = torch.zeros((len(bins), packed_width), dtype=torch.long)
    attention = torch.zeros((len(bins), 1, packed_width, packed_width), dtype=torch.bool)
    causal = torch.ones((packed_width, packed_width), dtype=torch.bool).tril()
    for row, members in enumerate(bins):
        start = 0
        for i in members:
            p, c, r = prompts[i], chosen[i], rejected[i]
            first = row * packed_width + start
            slot_of[i * width : i * width + p + c] = torch.arange(first, first + p + c)
            second = (n + i) * width
            slot_of[second : second + p] = torch.arange(first, first + p)  # the same prompt slots
            slot_of[second + p : second + p + r] = torch.arange(first + p + c, first + p + c + r)
            position_ids[row, start : start + p + c] = torch.arange(p + c)
            position_ids[row, start + p + c : start + p + c + r] = torch.arange(p, p + r)
            end = start + p + c + r
            attention[row, 0, start:end, start:end] = causal[: end - start, : end - start]
            attention[row, 0, start + p + c : end, start + p : start + p + c] = False  # rejected ∌ chosen
            start = end
        # the padded tail: a sequence of its own, so that no attention row is empty
        position_ids[row, start:] = torch.arange(packed_width - start)
        attention[row, 0, start:, start:] = causal[: packed_width - start, : packed_width - start]
    return PackedLayout((2 * n, width), slot_of, position_ids, attention)
