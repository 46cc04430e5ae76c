"""`mixed_precision` as documented. On CUDA: ``auto`` is bf16 where supported. On the CPU only an
explicit ``bf16`` autocasts: ``auto``, ``fp16`` and ``no`` train in plain fp32, bit for bit, and ``bf16``
computes its matrix products in bf16 while its losses stay within bf16's rounding of the fp32 run's
(the accuracy check; the speed is in docs/benchmarks.md). A value outside the list is refused naming
the hyperparameter. What the loop does with fp16 (a gradient scaler whose state is checkpointed and
restored) is tested on the CPU in tests/trainers/core/test_loop.py, with the GPU's answer stubbed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from torch.utils._python_dispatch import TorchDispatchMode

from tests.trainers.helpers import Recorder
from tests.trainers.methods.test_dpo import separable_rows
from trainers.core.errors import DataError
from trainers.core.precision import PRECISIONS, autocast_dtype
from trainers.families.entry import load_model_to_train
from trainers.methods.dpo import DPOConfig, train_dpo
from trainers.methods.sft import SFTConfig, train_sft


def test_the_cpu_autocasts_only_an_explicit_bf16() -> None:
    cpu = torch.device("cpu")
    assert {p: autocast_dtype(p, cpu) for p in PRECISIONS} == {
        "auto": None,
        "no": None,
        "bf16": torch.bfloat16,
        "fp16": None,
    }
    with pytest.raises(ValueError, match="mixed_precision must be one of"):
        autocast_dtype("fp8", cpu)


@pytest.fixture
def on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainers on the CPU even on a GPU host (where the settings do apply: run there, the fp32 test
    failed before it had this)."""
    for module in ("trainers.methods.sft", "trainers.methods.dpo"):
        monkeypatch.setattr(f"{module}.pick_device", lambda: torch.device("cpu"))


@pytest.mark.parametrize("precision", ["fp16", "auto"])
@pytest.mark.usefixtures("on_the_cpu")
def test_a_precision_setting_on_cpu_repeats_the_fp32_run(
    make_config: Callable[..., SFTConfig], demo_rows: list[dict[str, Any]], precision: str
) -> None:
    runs = {}
    for setting in ("no", precision):
        rec = Recorder()
        train_sft(
            make_config(mixed_precision=setting, max_steps=3, batch_size=4), demo_rows[:12], callbacks=rec
        )
        runs[setting] = [(r["loss"], r["grad_norm"]) for r in rec.steps]
    assert runs[precision] == runs["no"]  # bit for bit: no autocast, no gradient scaler


class MatmulDtypes(Recorder):
    """Records the run, and the dtypes of the ``aten.mm``/``addmm`` products of its steps (every linear
    layer's, forward and backward, seen below autocast) until the last step is done: the final save
    merges a LoRA adapter in its own dtype, outside training."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.last_step, self.dtypes = steps, set[torch.dtype]()

    @contextmanager
    def watching(self) -> Iterator[None]:
        recorder = self

        class Spy(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                training = len(recorder.steps) < recorder.last_step
                if training and func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                    recorder.dtypes.add(args[-1].dtype)
                return func(*args, **(kwargs or {}))

        with Spy():
            yield


@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
@pytest.mark.usefixtures("on_the_cpu")
def test_bf16_on_cpu_computes_in_bf16_within_its_rounding_of_the_fp32_run(
    make_config: Callable[..., SFTConfig], demo_rows: list[dict[str, Any]], use_lora: bool
) -> None:
    """The accuracy check: 12 steps of SFT, the losses of the bf16 run follow the fp32 run's within 1%
    (bf16 keeps 8 bits of mantissa: a product's relative rounding is ~0.4%), and they are not the same
    numbers (the products did run in bf16: every one of them, forward and backward)."""
    runs: dict[str, list[float]] = {}
    for setting in ("no", "bf16"):
        rec = MatmulDtypes(steps=12)
        config = make_config(
            mixed_precision=setting,
            use_lora=use_lora,
            max_steps=12,
            batch_size=4,
            learning_rate=1e-2 if use_lora else 1e-3,
        )
        with rec.watching():
            train_sft(config, demo_rows[:48], callbacks=rec)
        assert rec.dtypes == {torch.bfloat16 if setting == "bf16" else torch.float32}
        runs[setting] = rec.losses
    assert runs["bf16"] != runs["no"]
    assert runs["bf16"] == pytest.approx(runs["no"], rel=1e-2)
    assert runs["bf16"][-1] < runs["bf16"][0] * 0.95  # and it trains


@pytest.mark.usefixtures("on_the_cpu")
def test_bf16_dpo_on_cpu_follows_the_fp32_run(tiny_model_path: Path, tmp_path: Path) -> None:
    """The pair methods' own paths under CPU autocast: the shared-prompt rows' float attention mask, the
    chunked head's log-probs, the reference's forward."""
    rows = separable_rows(16)
    runs = {}
    for setting in ("no", "bf16"):
        rec = Recorder()
        config = DPOConfig(
            model_path=str(tiny_model_path),
            output_dir=str(tmp_path / setting),
            mixed_precision=setting,
            max_steps=4,
            batch_size=4,
            learning_rate=1e-2,
        )
        train_dpo(config, rows, callbacks=rec)
        runs[setting] = rec.losses
    assert runs["bf16"] != runs["no"]
    assert runs["bf16"] == pytest.approx(runs["no"], rel=2e-2)


def test_a_bf16_lora_run_keeps_its_frozen_base_in_bf16_and_its_adapter_in_fp32(
    make_config: Callable[..., SFTConfig],
) -> None:
    model = load_model_to_train(make_config(mixed_precision="bf16"), torch.device("cpu"))
    assert isinstance(model, PeftModel)
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert trained == {torch.float32} and frozen == {torch.bfloat16}


def test_an_unknown_precision_is_refused_naming_the_hyperparameter(
    make_config: Callable[..., SFTConfig],
) -> None:
    with pytest.raises(DataError) as caught:
        make_config(mixed_precision="fp8").validate()
    assert caught.value.param == "hyperparameters.mixed_precision"
