"""Where a training run lets other runs on the same model take their turn: between optimizer steps.

Several jobs can train in one process on one base model (``trainers.families.shared_base``): each in a
thread of its own, holding the model alone from its start to its end except at this point, which the
loop reaches after every optimizer step (and its evaluation and checkpoint). A thread that trains alone
has no turn to pass: ``between_steps`` does nothing then.

Why not finer: a step's forward, backward and optimizer update must see one adapter active and the
run's own random state from the first to the last; anything outside the loop (loading, tokenizing, a
reference pass) runs in one piece too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_local = threading.local()


def between_steps() -> None:
    """Let the other runs on this thread's model take a turn (and come back with this run's state)."""
    pass_turn: Callable[[], None] | None = getattr(_local, "pass_turn", None)
    if pass_turn is not None:
        pass_turn()


def set_pass_turn(pass_turn: Callable[[], None] | None) -> None:
    """This thread's way of passing its turn (None: it trains alone)."""
    _local.pass_turn = pass_turn
