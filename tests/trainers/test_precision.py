"""`mixed_precision` as documented: a CUDA-only choice. On CPU every setting trains in plain fp32 (CPU
autocast to bf16 is slower than fp32 on most CPUs and changes the numbers), and a value outside the
list is refused naming the hyperparameter. What the loop does with a GPU's answer (bf16 autocast, fp16
with a gradient scaler whose state is checkpointed and restored) is tested on the CPU in
tests/trainers/test_loop.py, with that one answer stubbed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.trainers.helpers import Recorder
from trainers.errors import DataError
from trainers.modeling import PRECISIONS, autocast_dtype
from trainers.sft import SFTConfig, train_sft


def test_cpu_trains_in_fp32_whatever_the_setting() -> None:
    cpu = torch.device("cpu")
    assert [autocast_dtype(p, cpu) for p in PRECISIONS] == [None] * len(PRECISIONS)
    with pytest.raises(ValueError, match="mixed_precision must be one of"):
        autocast_dtype("fp8", cpu)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "auto"])
def test_a_precision_setting_on_cpu_repeats_the_fp32_run(
    make_config: Callable[..., SFTConfig],
    demo_rows: list[dict[str, Any]],
    precision: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # on the CPU even on a GPU host (where the setting does apply: run there, this test failed before)
    monkeypatch.setattr("trainers.sft.pick_device", lambda: torch.device("cpu"))
    runs = {}
    for setting in ("no", precision):
        rec = Recorder()
        train_sft(
            make_config(mixed_precision=setting, max_steps=3, batch_size=4), demo_rows[:12], callbacks=rec
        )
        runs[setting] = [(r["loss"], r["grad_norm"]) for r in rec.steps]
    assert runs[precision] == runs["no"]  # bit for bit: no autocast, no gradient scaler


def test_an_unknown_precision_is_refused_naming_the_hyperparameter(
    make_config: Callable[..., SFTConfig],
) -> None:
    with pytest.raises(DataError) as caught:
        make_config(mixed_precision="fp8").validate()
    assert caught.value.param == "hyperparameters.mixed_precision"
