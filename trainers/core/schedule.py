"""Learning-rate schedules: a multiplier of the peak rate as a pure function of the optimizer step.

Linear warmup from 0 over ``warmup_steps``, then ``linear`` decay to 0, ``cosine`` decay to 0
(half a cosine period), or ``constant``; the same curves as transformers' ``get_scheduler``.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from trainers.registry import choices

SCHEDULES = choices("supervised", "lr_scheduler")


def lr_multiplier(step: int, *, kind: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier for the update made at 0-based optimizer ``step``.

    >>> [round(lr_multiplier(s, kind="linear", warmup_steps=2, total_steps=6), 2) for s in range(6)]
    [0.0, 0.5, 1.0, 0.75, 0.5, 0.25]
    """
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if kind == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    if kind == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"unknown lr_scheduler {kind!r}; expected one of {SCHEDULES}")


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, kind: str, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    fn = partial(lr_multiplier, kind=kind, warmup_steps=warmup_steps, total_steps=total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
