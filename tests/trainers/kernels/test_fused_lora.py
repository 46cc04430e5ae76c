"""A trainer's LoRA layers run fused (trainers/kernels/fused_lora.py): the same loss and gradients as peft's
forward, in fp32 to the order of the sums and under bf16 autocast to bf16's rounding, and peft's own
forward wherever the layer is not plain LoRA at that call."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from peft.tuners.lora import Linear as LoraLinear

from tests.trainers.helpers import model_settings
from trainers.core.precision import autocast_dtype, computing_in
from trainers.families.entry import load_classifier_to_train, load_model_to_train
from trainers.kernels import fused_lora

IDS = torch.tensor([[5, 9, 14, 3, 22, 7, 40], [11, 4, 8, 30, 2, 6, 0]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]])


def _with_trained_adapter(model: torch.nn.Module) -> torch.nn.Module:
    """``B`` starts at zero, which would hide a wrong adapter product: random ``A`` and ``B``."""
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model


def _through_peft(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose LoRA layers run peft's own forward."""
    plain = copy.deepcopy(model)
    for module in plain.modules():
        if isinstance(module, LoraLinear):
            del module.forward
    return plain


def _loss_and_gradients(
    model: torch.nn.Module, compute: torch.dtype | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with computing_in(model, compute, torch.device("cpu")):
        out = model(input_ids=IDS, attention_mask=MASK, labels=IDS.masked_fill(MASK == 0, -100))
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per fused product run (its rows)."""
    calls: list[int] = []
    fused = fused_lora._LoraProduct.forward

    def counted(ctx: Any, x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return fused(ctx, x, *args)

    monkeypatch.setattr(fused_lora._LoraProduct, "forward", staticmethod(counted))
    return calls


def test_a_trainers_lora_layers_train_as_peft_computes_them(
    tiny_model_path: Path, fused_calls: list[int]
) -> None:
    model = _with_trained_adapter(load_model_to_train(model_settings(tiny_model_path), torch.device("cpu")))
    plain = _through_peft(model)

    loss, grads = _loss_and_gradients(model, None)
    n_layers = sum(isinstance(m, LoraLinear) for m in model.modules())
    assert len(fused_calls) == n_layers == 2 * 7  # every adapted projection of the two layers, fused
    fused_calls.clear()
    plain_loss, plain_grads = _loss_and_gradients(plain, None)
    assert fused_calls == []

    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == plain_grads.keys()
    assert sum("lora_A" in n for n in grads) == sum("lora_B" in n for n in grads) == n_layers
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_under_bf16_autocast_the_products_run_in_bf16_and_the_adapter_trains_in_fp32(
    tiny_model_path: Path, fused_calls: list[int]
) -> None:
    """The fp32 test above checks the arithmetic. In bf16 this tiny random model's gradients are mostly
    rounding (peft's own differ from fp32's by more than their size), so here: the dtypes, and the loss
    within bf16's reach of peft's."""
    settings = model_settings(tiny_model_path, mixed_precision="bf16")
    model = _with_trained_adapter(load_model_to_train(settings, torch.device("cpu")))
    plain = _through_peft(model)
    compute = autocast_dtype("bf16", torch.device("cpu"))
    outputs: list[torch.dtype] = []
    for module in model.modules():
        if isinstance(module, LoraLinear):
            module.register_forward_hook(lambda _m, _i, out: outputs.append(out.dtype))
    loss, grads = _loss_and_gradients(model, compute)
    plain_loss, _ = _loss_and_gradients(plain, compute)
    assert len(fused_calls) == len(outputs) == 2 * 7 and set(outputs) == {torch.bfloat16}
    assert {grad.dtype for grad in grads.values()} == {torch.float32}
    torch.testing.assert_close(loss, plain_loss, rtol=1e-3, atol=0)


def test_a_reward_models_lora_layers_are_fused_and_its_head_trains(
    tiny_model_path: Path, fused_calls: list[int]
) -> None:
    model = _with_trained_adapter(
        load_classifier_to_train(model_settings(tiny_model_path), torch.device("cpu"), pad_token_id=0)
    )
    plain = _through_peft(model)
    scores = model(input_ids=IDS, attention_mask=MASK).logits
    assert len(fused_calls) == 2 * 7
    scores.sum().backward()
    plain_scores = plain(input_ids=IDS, attention_mask=MASK).logits
    plain_scores.sum().backward()
    torch.testing.assert_close(scores, plain_scores, rtol=1e-5, atol=1e-6)
    plain_grads = dict(plain.named_parameters())
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            torch.testing.assert_close(parameter.grad, plain_grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def test_layers_that_are_not_plain_lora_at_a_call_run_peft_forward(
    tiny_model_path: Path, fused_calls: list[int]
) -> None:
    """A disabled adapter (a DPO reference) gives the base model's outputs, dropout on the adapter's
    input is peft's to apply, and a base layer that trains gets its gradient from peft's forward: none
    of them runs the fused product."""
    model = _with_trained_adapter(load_model_to_train(model_settings(tiny_model_path), torch.device("cpu")))
    assert isinstance(model, PeftModel)
    base = _through_peft(model)
    with torch.no_grad():
        adapted = model(input_ids=IDS).logits
        fused_calls.clear()
        with model.disable_adapter():
            disabled = model(input_ids=IDS).logits
        assert fused_calls == []
        with base.disable_adapter():
            torch.testing.assert_close(disabled, base(input_ids=IDS).logits, rtol=0, atol=0)
    assert (adapted - disabled).abs().max() > 0.1

    with_dropout = load_model_to_train(model_settings(tiny_model_path, lora_dropout=0.1), torch.device("cpu"))
    with_dropout(input_ids=IDS)
    assert fused_calls == []

    # a base layer that trains (its bias here) needs its own gradient, which the fused product leaves out
    layer = next(m for m in model.modules() if isinstance(m, LoraLinear))
    layer.base_layer.bias = torch.nn.Parameter(torch.zeros(layer.base_layer.out_features))
    model(input_ids=IDS).logits.sum().backward()
    assert len(fused_calls) == 2 * 7 - 1
    assert layer.base_layer.bias.grad is not None and layer.base_layer.bias.grad.abs().sum() > 0
