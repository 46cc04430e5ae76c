"""Test helpers: a callback that records everything and can ask the loop to stop."""

from __future__ import annotations

from typing import Any

from trainers.loop import CheckpointInfo, NullCallbacks, StopRequest


class Recorder(NullCallbacks):
    """Records every callback; ``stop_after`` maps a step count to the stop request issued once it is done."""

    def __init__(self, stop_after: dict[int, StopRequest] | None = None) -> None:
        self.stop_after = stop_after or {}
        self.begin: dict[str, int] = {}
        self.steps: list[dict[str, float]] = []
        self.evals: list[dict[str, float]] = []
        self.epochs: list[tuple[int, int]] = []
        self.checkpoints: list[CheckpointInfo] = []

    def on_train_begin(self, *, total_steps: int, n_epochs: int) -> None:
        self.begin = {"total_steps": total_steps, "n_epochs": n_epochs}

    def on_step(self, row: dict[str, float]) -> None:
        self.steps.append(row)

    def on_eval(self, row: dict[str, float]) -> None:
        self.evals.append(row)

    def on_epoch_end(self, *, epoch: int, step: int) -> None:
        self.epochs.append((epoch, step))

    def on_checkpoint(self, ckpt: CheckpointInfo) -> None:
        self.checkpoints.append(ckpt)

    def should_stop(self) -> StopRequest | None:
        return self.stop_after.get(len(self.steps))

    @property
    def losses(self) -> list[float]:
        return [row["loss"] for row in self.steps]


# A resume run that exercises every restored state: 2 rows a micro-batch, 2 micro-batches a step, so
# 6 steps cross an epoch; warmup, a cosine schedule and weight decay make the scheduler and optimizer
# states matter. Tests checkpoint at step 3 and compare steps 4-6 with an uninterrupted run.
RESUME_RUN: dict[str, Any] = {
    "batch_size": 2,
    "gradient_accumulation_steps": 2,
    "n_epochs": 2,
    "max_steps": 6,
    "save_steps": 3,
    "warmup_ratio": 0.2,
    "lr_scheduler": "cosine",
    "weight_decay": 0.01,
    "seed": 7,
}
