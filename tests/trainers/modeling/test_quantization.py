"""QLoRA (``quantization``): the tiny model trains through the trainer entries with its base in NF4 (double
quantization) or LLM.int8 on bitsandbytes' CPU backend, close to the unquantized run; the DPO reference is
the quantized base with the adapter off; resume is exact; the final checkpoint is the adapter merged into
the dequantized base, a plain model that computes what the trained one did.

Tolerance against the unquantized run, ``LOSS_TOLERANCE`` nats per step: NF4 moves each base weight by
up to half a step of its block's 16 levels. On the tiny model (random weights, near-uniform logits over
512 tokens, fp32 compute) the losses of 4 steps differed by at most 0.002 (SFT) and 0.008 (DPO, where
the gap grows with the margin it learns). 0.02 leaves room for another CPU's rounding, and stays well
under what the runs learn in those steps (each loss falls by more than 0.15), so a run whose adapter
did not train falls outside it; a reference that is not the base being trained shows in DPO's first
loss, which is log 2 only when policy and reference are the same quantized model. The SmolLM2 figures
(a trained model, where quantization error matters more) are bench/qlora.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from bitsandbytes.nn import Linear4bit, Linear8bitLt
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from tests.trainers.helpers import RESUME_RUN, Recorder, model_settings, small_config
from tests.trainers.methods.test_dpo import separable_rows
from trainers.core.checkpoint import merged_model
from trainers.core.errors import DataError
from trainers.methods.dpo import DPOConfig, train_dpo
from trainers.methods.reward_model import train_reward_model
from trainers.methods.sft import SFTConfig, train_sft
from trainers.modeling.loading import load_model

LOSS_TOLERANCE = 0.02
SFT_RUN: dict[str, Any] = {"max_steps": 4, "batch_size": 4, "learning_rate": 1e-2, "seed": 3}
DPO_RUN: dict[str, Any] = {"max_steps": 4, "batch_size": 4, "learning_rate": 1e-2, "seed": 3}


def _assert_close_but_quantized(quantized: list[float], plain: list[float]) -> None:
    gaps = [abs(q - p) for q, p in zip(quantized, plain, strict=True)]
    assert max(gaps) <= LOSS_TOLERANCE, gaps
    assert max(gaps) > 1e-6, "the quantized run computed exactly the unquantized one: not quantized?"


def test_the_base_loads_in_nf4_with_double_quantization_and_the_adapter_in_fp32(
    tiny_model_path: Path,
) -> None:
    model = load_model(model_settings(tiny_model_path, quantization="nf4"), torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    assert len(layers) == 2 * 7  # every linear layer of the 2 decoder layers; not the head
    state = layers[0].weight.quant_state
    assert state.quant_type == "nf4" and state.nested  # nested: the block scales quantized again
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    assert type(model.get_base_model().lm_head) is torch.nn.Linear


def test_sft_trains_in_nf4_close_to_the_unquantized_run(
    make_config: Callable[..., SFTConfig], demo_rows: list[dict[str, Any]], tmp_path: Path
) -> None:
    runs = {}
    for quantization in (None, "nf4"):
        rec = Recorder()
        out = str(tmp_path / str(quantization))
        train_sft(make_config(**SFT_RUN, quantization=quantization, output_dir=out), demo_rows, callbacks=rec)
        runs[quantization] = rec.losses
    assert runs["nf4"][-1] < runs["nf4"][0] - 0.15
    _assert_close_but_quantized(runs["nf4"], runs[None])


def test_dpo_reference_is_the_quantized_base_and_trains_close_to_the_unquantized_run(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    rows = separable_rows(16)
    runs = {}
    for quantization in (None, "nf4"):
        rec = Recorder()
        config = DPOConfig(
            model_path=str(tiny_model_path),
            output_dir=str(tmp_path / str(quantization)),
            quantization=quantization,
            **DPO_RUN,
        )
        train_dpo(config, rows, callbacks=rec)
        runs[quantization] = rec.losses
    # before the first update the policy is its reference: log 2 exactly only if the reference is the
    # same quantized base (an unquantized reference would differ by the quantization error)
    assert runs["nf4"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert runs["nf4"][-1] < runs["nf4"][0] - 0.15
    _assert_close_but_quantized(runs["nf4"], runs[None])


def test_a_resumed_nf4_run_repeats_the_uninterrupted_one(
    make_config: Callable[..., SFTConfig], demo_rows: list[dict[str, Any]], tmp_path: Path
) -> None:
    rows = demo_rows[:16]
    run = {**RESUME_RUN, "quantization": "nf4", "learning_rate": 1e-2}
    full = Recorder()
    train_sft(make_config(**run, output_dir=str(tmp_path / "a")), rows, callbacks=full)
    mid = full.checkpoints[0].path
    resumed = Recorder()
    train_sft(
        make_config(**run, output_dir=str(tmp_path / "b"), resume_from=str(mid)), rows, callbacks=resumed
    )
    assert [int(r["step"]) for r in resumed.steps] == [4, 5, 6]
    for ours, theirs in zip(resumed.steps, full.steps[3:], strict=True):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-6), key


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_the_export_is_the_adapter_merged_into_the_dequantized_base(
    tiny_model_path: Path, tmp_path: Path, quantization: str
) -> None:
    """A trained-looking adapter (random ``B``) on a quantized base, exported: a plain fp32 model, no
    quantization config, whose logits are the quantized model's with its adapter (not the original
    base's plus the adapter, nor a re-quantized merge)."""
    settings = model_settings(tiny_model_path, quantization=quantization)
    model = load_model(settings, torch.device("cpu"))
    quantized_type = Linear4bit if quantization == "nf4" else Linear8bitLt
    assert any(isinstance(m, quantized_type) for m in model.modules())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    ids = torch.randint(0, 500, (2, 12), generator=generator)
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    merged = merged_model(model)
    out = tmp_path / "export"
    merged.save_pretrained(out)
    assert "quantization_config" not in (out / "config.json").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert all(p.dtype == torch.float32 for p in reloaded.parameters())
    assert not any(isinstance(m, Linear4bit | Linear8bitLt) for m in reloaded.modules())
    with torch.no_grad():
        exported = reloaded(input_ids=ids).logits
        original = AutoModelForCausalLM.from_pretrained(tiny_model_path)(input_ids=ids).logits
    # NF4 quantizes weights only: the exported fp32 layer is the product the trained one ran, up to how
    # bitsandbytes' CPU kernel rounds it (within 1e-5 on earlier hosts; 2.6e-3 on an AVX512-BF16 one: a bf16
    # product). LLM.int8 also rounds each product's inputs to 8 bits, which no plain model does (5e-3).
    # Both far below the adapter's own effect (0.5, the next line), which a merge that lost it would miss.
    assert torch.allclose(exported, trained, atol=1e-2 if quantization == "nf4" else 2e-2)
    assert not torch.allclose(exported, original, atol=0.1)  # the adapter is in it


def test_a_reward_model_trains_on_an_nf4_base_with_its_head_in_full(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    config = small_config("reward_model", tiny_model_path, tmp_path / "rm", quantization="nf4", max_steps=2)
    rec = Recorder()
    result = train_reward_model(config, separable_rows(8), callbacks=rec)
    assert len(rec.steps) == 2 and all(math.isfinite(loss) for loss in rec.losses)
    assert result.final_checkpoint is not None
    exported = AutoModelForSequenceClassification.from_pretrained(result.final_checkpoint.path / "model")
    assert type(exported.score) is torch.nn.Linear
    assert not any(isinstance(m, Linear4bit) for m in exported.modules())


def test_quantization_without_lora_is_refused_naming_the_field(
    make_config: Callable[..., SFTConfig], demo_rows: list[dict[str, Any]]
) -> None:
    with pytest.raises(DataError) as raised:
        train_sft(make_config(quantization="nf4", use_lora=False, max_steps=1), demo_rows)
    assert raised.value.param == "hyperparameters.quantization"
