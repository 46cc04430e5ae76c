"""How a training loop talks to whoever runs it (the worker): progress out, stop requests in.

Re-exported by ``trainers.core.loop``. Every hook is called from the training thread and must be cheap:
``on_step`` and ``should_stop`` run once per optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol


class StopRequest(StrEnum):
    CANCEL = "cancel"  # stop now, write nothing
    PAUSE = "pause"  # write a resumable checkpoint, then stop


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path  # the checkpoint folder; the Hugging Face model is in `path / "model"`
    step: int
    epoch: float
    final: bool  # True: `model/` holds full (LoRA-merged) weights and there may be no `state/`
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainResult:
    # None when cancelled, and on every rank but 0 (rank 0 writes); the pause checkpoint when paused
    final_checkpoint: CheckpointInfo | None
    stopped: StopRequest | None  # None when training ran to the end
    steps: int  # optimizer steps done, counting those before a resume
    metrics: dict[str, float] = field(default_factory=dict)  # last step row + last eval row


class TrainingCallbacks(Protocol):
    def on_train_begin(self, *, total_steps: int, n_epochs: int) -> None: ...

    def on_step(self, row: dict[str, float]) -> None:
        """After every optimizer step. Keys: step (1-based), epoch, loss, learning_rate, grad_norm (before
        clipping), tokens_per_second, trained_tokens (cumulative), total_steps; the method's metrics ride
        in the same row: mean_token_accuracy (SFT); rewards/chosen, rewards/rejected, rewards/accuracies,
        rewards/margins, logps/* (DPO); accuracy, rewards/* (reward model); for the RL methods the
        rollout's reward (GRPO) or score (PPO), kl, completions/*, rewards/{name}/mean, and the loss
        statistics (clip_ratio, entropy for GRPO; policy_loss, value_loss, approx_kl, clip_fraction,
        entropy for PPO)."""

    def on_eval(self, row: dict[str, float]) -> None:
        """Keys: step, epoch, valid_loss, and valid_{name} for each of the method's loss metrics (e.g.
        valid_mean_token_accuracy for SFT, valid_accuracy for the reward model)."""

    def on_epoch_end(self, *, epoch: int, step: int) -> None:
        """``epoch``: the number of epochs completed (1 after the first)."""

    def on_checkpoint(self, ckpt: CheckpointInfo) -> None:
        """After the checkpoint folder is complete on disk."""

    def should_stop(self) -> StopRequest | None:
        """Checked before every optimizer step."""

    def on_message(self, message: str) -> None:
        """A line for whoever watches the run (the job's events): work the trainer skipped or did
        differently, e.g. reference log-probs reused from an earlier run."""


class NullCallbacks:
    """Callbacks that do nothing; subclass and override what you need."""

    def on_train_begin(self, *, total_steps: int, n_epochs: int) -> None:
        return None

    def on_step(self, row: dict[str, float]) -> None:
        return None

    def on_eval(self, row: dict[str, float]) -> None:
        return None

    def on_epoch_end(self, *, epoch: int, step: int) -> None:
        return None

    def on_checkpoint(self, ckpt: CheckpointInfo) -> None:
        return None

    def should_stop(self) -> StopRequest | None:
        return None

    def on_message(self, message: str) -> None:
        return None
