"""Rollouts sample through LoRA weights merged into the base (trainers/kernels/merged_lora.py): the same model
as the adapter's products compute, none of those products while sampling, and the frozen base the
same bits afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from tests.trainers.helpers import model_settings
from trainers.families.entry import load_model_to_train
from trainers.families.rollout import generate_rollout, tokenize_rl_rows
from trainers.kernels import fused_lora
from trainers.kernels.merged_lora import merged_lora

IDS = torch.tensor([[5, 9, 14, 3, 22, 7], [11, 4, 8, 30, 2, 6]])


def _lora_model(path: Path, precision: str = "no") -> PeftModel:
    """A LoRA model as a run loads it (``bf16``: its frozen base in bf16), with an adapter that
    changes the outputs (``B`` is zero at initialisation)."""
    settings = model_settings(path, lora_r=8, lora_alpha=16, mixed_precision=precision)
    model = load_model_to_train(settings, torch.device("cpu"))
    assert isinstance(model, PeftModel)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    model.eval()
    return model


def _adapter_calls(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts the adapters' products: each ``A`` product through peft appends the module's name, each
    layer's fused product (trainers/kernels/fused_lora.py, how a trainer's model runs them) appends
    "fused"."""
    calls: list[str] = []
    for name, module in model.named_modules():
        if name.endswith("lora_A.default"):
            module.register_forward_hook(lambda *_, n=name: calls.append(n))
    fused = fused_lora._LoraProduct.forward

    def counted(ctx: Any, *args: Any) -> torch.Tensor:
        calls.append("fused")
        return fused(ctx, *args)

    monkeypatch.setattr(fused_lora._LoraProduct, "forward", staticmethod(counted))
    return calls


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def _assert_same_bits(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_merged_model_computes_the_adapters_outputs_without_their_products(
    tiny_model_path: Path, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _lora_model(tiny_model_path, precision)
    before = _weights(model)
    calls = _adapter_calls(model, monkeypatch)
    with torch.no_grad():
        unmerged = model(input_ids=IDS).logits.float()
        assert calls, "the hook sees the adapter's products"
        calls.clear()
        with merged_lora(model):
            merged = model(input_ids=IDS).logits.float()
        with model.disable_adapter():
            base = model(input_ids=IDS).logits.float()
    assert calls == []
    # fp32: the same model up to the order of the sums (9e-7 here); bf16: up to the merged weight's
    # rounding (0.03); the adapter itself moves the logits by 0.8
    tolerance = 1e-5 if precision == "no" else 0.08
    assert (merged - unmerged).abs().max() < tolerance < (base - unmerged).abs().max() / 10
    _assert_same_bits(model, before)


def test_the_base_is_restored_when_the_block_raises(tiny_model_path: Path) -> None:
    model = _lora_model(tiny_model_path)
    before = _weights(model)
    with pytest.raises(RuntimeError, match="mid-rollout"), merged_lora(model):
        raise RuntimeError("mid-rollout")
    _assert_same_bits(model, before)
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, _lora_model(tiny_model_path)(input_ids=IDS).logits)


def test_a_disabled_adapter_stays_out(tiny_model_path: Path) -> None:
    """The reference model of the KL term is the policy with its adapter disabled: merging there would
    sample from the policy instead."""
    model = _lora_model(tiny_model_path)
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=IDS).logits
        with merged_lora(model):
            inside = model(input_ids=IDS).logits
    assert torch.equal(inside, base)


def test_a_model_without_adapters_runs_as_it_is(tiny_model_path: Path) -> None:
    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.eval()
    before = _weights(model)
    with torch.no_grad(), merged_lora(model):
        inside = model(input_ids=IDS).logits
    with torch.no_grad():
        assert torch.equal(inside, model(input_ids=IDS).logits)
    _assert_same_bits(model, before)


def test_rollouts_sample_merged_and_leave_the_base_as_it_was(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _lora_model(tiny_model_path)
    model.train()
    before = _weights(model)
    rows = [{"prompt": "Hi there"}, {"prompt": "Capital of Peru?"}]
    prompts = tokenize_rl_rows(rows, tokenizer, max_prompt_length=64)
    kw: dict[str, Any] = {"num_generations": 3, "max_completion_length": 10, "seed": 3, "greedy": True}
    calls = _adapter_calls(model, monkeypatch)
    rollout = generate_rollout(model, tokenizer, prompts, **kw)
    assert calls == []
    _assert_same_bits(model, before)
    assert model.training  # sampling's eval mode is undone too
    # greedy sampling through the adapter's products picks the same tokens
    with torch.no_grad():
        ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)
        mask = torch.cat([rollout.prompt_mask, torch.ones_like(rollout.completion_ids)], dim=1)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        model.eval()
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    width = rollout.prompt_ids.size(1)
    picked = logits[:, width - 1 : -1].argmax(-1)
    real = rollout.completion_mask.bool()
    assert calls and torch.equal(picked[real], rollout.completion_ids[real])
