"""Test helpers: a callback that records everything and can ask the loop to stop; packed against padded;
the model settings a trainer loads a model with."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from trainers.core.loop import CheckpointInfo, NullCallbacks, StopRequest
from trainers.modeling import loading as modeling
from trainers.registry import METHODS, resolve


class Recorder(NullCallbacks):
    """Records every callback; ``stop_after`` maps a step count to the stop request issued once it is done."""

    def __init__(self, stop_after: dict[int, StopRequest] | None = None) -> None:
        self.stop_after = stop_after or {}
        self.begin: dict[str, int] = {}
        self.steps: list[dict[str, float]] = []
        self.evals: list[dict[str, float]] = []
        self.epochs: list[tuple[int, int]] = []
        self.checkpoints: list[CheckpointInfo] = []
        self.messages: list[str] = []

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

    def on_message(self, message: str) -> None:
        self.messages.append(message)

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


# One optimizer step of 2 examples with 4-token completions, for any method: the keys a config lacks are
# left out (see small_config).
SMALL_RUN: dict[str, Any] = {
    "max_steps": 1,
    "batch_size": 2,
    "max_completion_length": 4,
    "num_generations": 2,
    "num_ppo_epochs": 1,
    "num_mini_batches": 1,
}


def model_settings(model_path: Path, **overrides: Any) -> SimpleNamespace:
    """What ``modeling.load_model`` reads of a config: a LoRA model (r 4) in fp32, + ``overrides``."""
    fields: dict[str, Any] = {
        "model_path": str(model_path),
        "use_lora": True,
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "lora_target_modules": None,
        "quantization": None,
        "gradient_checkpointing": False,
        "mixed_precision": "no",
        "resume_from": None,
    }
    return SimpleNamespace(**(fields | overrides))


def small_config(method: str, model_path: Path, output_dir: Path, **overrides: Any) -> Any:
    """The ``trainers.registry`` method's config for a tiny, fast run (``SMALL_RUN`` + ``overrides``)."""
    config_cls = resolve(METHODS[method].config)
    names = {f.name for f in dataclasses.fields(config_cls)}
    fields = {k: v for k, v in (SMALL_RUN | overrides).items() if k in names}
    return config_cls(model_path=str(model_path), output_dir=str(output_dir), **fields)


def assert_packed_trains_as_padded(
    train: Callable[[str, Recorder], Any], keys: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train(name, recorder)`` runs 3 steps twice, packed and then padded, with the same losses and
    metrics step by step; the padded run is the whole-model forward, forced by making the tiny Llama an
    architecture ``modeling`` does not know. The runs train in float32 on any device: bf16 rounding
    would differ between the two layouts."""
    packed, padded = Recorder(), Recorder()
    train("packed", packed)
    monkeypatch.setattr(modeling, "PLAIN_HEAD_MODELS", frozenset())
    train("padded", padded)
    assert len(packed.steps) == len(padded.steps) == 3
    for ours, expected in zip(packed.steps, padded.steps, strict=True):
        for key in keys:
            assert ours[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
