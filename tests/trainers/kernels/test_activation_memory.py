"""Decoder layers that keep less for backward (trainers/kernels/activation_memory.py): same values and
gradients
as transformers' own forwards, the MLP's product and the norms' outputs recomputed rather than kept."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from tests.trainers.helpers import model_settings
from trainers.core.precision import autocast_dtype, computing_in
from trainers.families.entry import load_model_to_train
from trainers.kernels import activation_memory
from trainers.kernels.activation_memory import recompute, recompute_scope, save_less_activation, silu_mul


def test_silu_mul_equals_silu_times_up_in_value_and_gradient() -> None:
    torch.manual_seed(0)
    gate = (torch.randn(5, 7, dtype=torch.float64) * 3).requires_grad_()
    up = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(silu_mul(gate, up), F.silu(gate) * up)
    assert torch.autograd.gradcheck(silu_mul, (gate, up))


class _CountingRecipe(activation_memory._Recipe):
    computed = 0

    def __init__(self, compute: Callable[[], torch.Tensor]) -> None:
        def counted() -> torch.Tensor:
            _CountingRecipe.computed += 1
            return compute()

        super().__init__(counted)


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> type[_CountingRecipe]:
    _CountingRecipe.computed = 0
    monkeypatch.setattr(activation_memory, "_Recipe", _CountingRecipe)
    return _CountingRecipe


def test_a_saved_tensor_is_recomputed_once_and_others_are_kept(counting: type[_CountingRecipe]) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, requires_grad=True)
    weight = torch.randn(5, 4, requires_grad=True)
    other_weight = torch.randn(5, 4, requires_grad=True)
    other = torch.randn(2, 3, 4)
    with recompute_scope():
        product = x * 2
        recompute(product, lambda: x.detach() * 2)
        # both linears save a 2-D view of the product; ``other`` is saved as it is
        out = F.linear(product, weight).sum() + F.linear(product, other_weight).sum()
        out = out + (other * weight.sum()).sum()
    recompute(x, lambda: x)  # outside a scope: nothing to do
    kept = weakref.ref(product)
    del product
    assert kept() is None  # neither autograd nor the closed scope holds the product
    out.backward()
    assert counting.computed == 1  # one recipe, shared by both linears
    expected = torch.ones(6, 5).T @ (x.detach() * 2).reshape(-1, 4)
    torch.testing.assert_close(weight.grad, expected + other.sum())
    torch.testing.assert_close(other_weight.grad, expected)


def _loss_and_gradients(
    model: torch.nn.Module, compute: torch.dtype | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and gradients of a fixed batch, under the CPU autocast a trainer uses for ``compute``."""
    torch.manual_seed(1)
    ids = torch.randint(3, 60, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with computing_in(model, compute, torch.device("cpu")):
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "phi3.5"])
@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
def test_a_model_trains_as_with_transformers_forwards_and_recomputes_each_product(
    tiny_model_path: Path,
    family_model: Callable[[str], Path],
    family: str,
    use_lora: bool,
    precision: str,
    counting: type[_CountingRecipe],
) -> None:
    """In fp32 and under CPU bf16 autocast (with LoRA, a bf16 frozen base), where the rebuilt tensors
    must come out in the dtype the forward gave them; on Llama, and on Phi-3's MLP, whose gate and up are
    one projection (tests/model_families.py)."""
    path = tiny_model_path if family == "llama" else family_model(family)
    settings = model_settings(path, use_lora=use_lora, mixed_precision=precision)
    compute = autocast_dtype(precision, torch.device("cpu"))
    model = load_model_to_train(settings, torch.device("cpu"))
    plain = copy.deepcopy(model)
    for module in plain.modules():
        if "forward" in vars(module) and not isinstance(module, LoraLinear):
            del module.forward  # back to the class's forward (transformers' own; LoRA's stay fused)
    # LoRA's B starts at zero and the norms' weights at one, which would hide a wrong recomputation
    for name, parameter in model.named_parameters():
        if "lora_B" in name or "norm" in name:
            with torch.no_grad():
                parameter.normal_(generator=torch.Generator().manual_seed(len(name)))
    plain.load_state_dict(model.state_dict())

    loss, grads = _loss_and_gradients(model, compute)
    # per layer of the tiny model: the MLP's product and both norms' outputs, plus both norms'
    # normalised inputs when their weights train. Under autocast a fully trained norm's output is fp32
    # and each projection keeps its own bf16 cast of it, so that output is not rebuilt (left alone: a
    # cast in the norm would sum the projections' gradients in bf16, where autocast sums them in fp32)
    norm_outputs = 0 if compute is not None and not use_lora else 2
    assert counting.computed == 2 * (1 + norm_outputs + (0 if use_lora else 2))
    computed = counting.computed
    plain_loss, plain_grads = _loss_and_gradients(plain, compute)
    assert counting.computed == computed
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=1e-6)
    assert grads.keys() == plain_grads.keys() and any("down_proj" in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
def test_a_layer_registers_only_what_backward_asks_for(
    tiny_model_path: Path, use_lora: bool, counting: type[_CountingRecipe], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registered tensor is held until its layer ends, so registering one that nothing saves (the
    normalised input of a frozen norm weight) would only keep it alive longer."""
    registered = []
    register = activation_memory._RecomputeScope.recompute

    def counted(scope: Any, tensor: torch.Tensor, compute: Callable[[], torch.Tensor]) -> None:
        registered.append(tensor.shape)
        register(scope, tensor, compute)

    monkeypatch.setattr(activation_memory._RecomputeScope, "recompute", counted)
    model = load_model_to_train(model_settings(tiny_model_path, use_lora=use_lora), torch.device("cpu"))
    _loss_and_gradients(model)
    assert len(registered) == counting.computed == 2 * (3 if use_lora else 5)


def _patched(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forward a trainer replaced, but for LoRA layers' (trainers/kernels/fused_lora.py)."""
    return [
        module
        for module in model.modules()
        if "forward" in vars(module) and not isinstance(module, LoraLinear)
    ]


def test_a_copied_model_runs_its_own_modules(tiny_model_path: Path) -> None:
    model = load_model_to_train(model_settings(tiny_model_path, use_lora=False), torch.device("cpu"))
    copied = _patched(copy.deepcopy(model))
    assert len(copied) == 2 * 4  # per layer: the layer, its MLP, its two norms
    assert all(module.forward.__self__ is module for module in copied)


def test_gradient_checkpointing_keeps_transformers_forwards(tiny_model_path: Path) -> None:
    model = load_model_to_train(
        model_settings(tiny_model_path, gradient_checkpointing=True), torch.device("cpu")
    )
    assert _patched(model) == []


def test_other_architectures_keep_their_forwards(tiny_model_path: Path) -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    assert save_less_activation(gpt2) == 0
    gelu = AutoModelForCausalLM.from_pretrained(tiny_model_path, hidden_act="gelu")
    assert save_less_activation(gelu) == 0 and _patched(gelu) == []
    assert save_less_activation(AutoModelForCausalLM.from_pretrained(tiny_model_path)) == 2


def test_without_gradients_nothing_is_kept_or_recomputed(
    tiny_model_path: Path, counting: type[_CountingRecipe]
) -> None:
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model = copy.deepcopy(plain)
    save_less_activation(model)
    ids = torch.randint(3, 60, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=0, atol=1e-6
        )
    assert counting.computed == 0


def test_the_reward_model_gets_the_jobs_activation_memory(tiny_model_path: Path) -> None:
    """A reward model's classifier gets its job's kernels as every method's model does (it once loaded
    without them, and `gradient_checkpointing` did nothing for it)."""
    from trainers.methods.reward_model import RewardModelConfig, _classifier

    config = RewardModelConfig(str(tiny_model_path), "/unused", use_lora=True)
    assert len(_patched(_classifier(config, torch.device("cpu"), 0))) == 2 * 4
