"""Shared fixtures for trainer tests: one tiny Llama per session, the demo rows, an SFTConfig factory."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from trainers.methods.sft import SFTConfig
from trainers.modeling.tiny_model import DEMO_SFT_PATH, build_tiny_model

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


@pytest.fixture(scope="session")
def eos_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its EOS logit raised, so that short samples mix stopped and truncated
    completions of different lengths: what masking, EOS handling and loss normalisation need to show."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("eos-llama")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] += 1.2
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
