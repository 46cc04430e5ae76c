"""Shared fixtures for trainer tests: one tiny Llama per session, the demo rows, a recording callback."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from trainers.loop import CheckpointInfo, NullCallbacks, StopRequest
from trainers.sft import SFTConfig
from trainers.tiny_model import DEMO_SFT_PATH, build_tiny_model

hf_logging.disable_progress_bar()  # "Loading weights" bars on every from_pretrained drown the test output


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def demo_rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in DEMO_SFT_PATH.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def make_config(tiny_model_path: Path, tmp_path: Path) -> Callable[..., SFTConfig]:
    """SFTConfig on the tiny model, writing under this test's tmp_path; keyword overrides win."""

    def make(**overrides: Any) -> SFTConfig:
        fields: dict[str, Any] = {"model_path": str(tiny_model_path), "output_dir": str(tmp_path / "out")}
        return SFTConfig(**(fields | overrides))

    return make


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
