"""Where a training run lets other runs on the same model take their turn: between optimizer steps, and
while it does work that does not touch the model (uploading a checkpoint).

Several jobs can train in one process on one base model (``trainers.families.shared_base``): each in a
thread of its own, holding the model alone from its start to its end except at these points. The loop
calls ``between_steps`` after every optimizer step (and its evaluation and checkpoint); whoever stores a
checkpoint's files elsewhere does it inside ``away()``. A thread that trains alone has no turn to pass:
both do nothing then.

Why not finer: a step's forward, backward and optimizer update must see one adapter active and the
run's own random state from the first to the last; anything outside the loop (loading, tokenizing, a
reference pass) runs in one piece too.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

_local = threading.local()


class Turn(Protocol):
    """A run's hold on a shared model."""

    def leave(self) -> None:
        """Let the other runs use the model (this run's state is kept aside)."""

    def retake(self) -> None:
        """Wait for the model, and come back with this run's adapter, random state and mode."""


def between_steps() -> None:
    """Let the other runs on this thread's model take a turn (and come back with this run's state)."""
    turn = _turn()
    if turn is not None:
        turn.leave()
        turn.retake()


@contextmanager
def away() -> Iterator[None]:
    """Let the other runs use the model while this thread does something that does not touch it (an
    upload, a database write): a job's I/O must not stall the jobs beside it."""
    turn = _turn()
    if turn is None:
        yield
        return
    turn.leave()
    try:
        yield
    finally:
        turn.retake()


def set_turn(turn: Turn | None) -> None:
    """This thread's hold on a shared model (None: it trains alone)."""
    _local.turn = turn


def _turn() -> Turn | None:
    turn: Turn | None = getattr(_local, "turn", None)
    return turn
