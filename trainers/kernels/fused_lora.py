"""A LoRA layer's forward and backward as one autograd function: the adapter's product added inside the
base product, and its scale applied to the rank-r tensors only.

peft computes ``base(x) + B(A(x)) * scaling``: the adapter's [tokens, out] product, its scaled copy and
their sum are three passes over the layer's output, and backward takes two more (the scale's gradient,
and the sum's). On a CPU those passes are bound by memory bandwidth, not arithmetic. Here forward adds
``scaling * (x A^T) B^T`` into the base product in place (``addmm_``), and backward scales the [tokens, r]
and [out, r] products instead of a [tokens, out] one. For one SmolLM2 MLP projection (2,345 tokens, 576
→ 1,536, r 8, bf16) forward and backward took ~2.3x as long through peft as here, and here ~1.5x as long
as without the adapter (git log -p docs/benchmarks.md).

The values are peft's up to rounding: the same products in the same dtype, summed in another order.
Only plain LoRA takes this path (one active adapter, no dropout, no DoRA or other variant, no adapter
bias, an ``nn.Linear`` base whose weight and bias do not train, not merged); any other call goes
through peft's forward, checked at each call since adapters can be disabled (a DPO reference) or
merged (rollouts).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from peft.tuners.lora import Linear as LoraLinear

from trainers.core.precision import product_dtype


class _LoraProduct(torch.autograd.Function):
    """``x W^T + bias + scaling * (x A^T) B^T`` for 2-D ``x`` [N, in], all in one dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        down = x @ lora_a.T  # [N, r]
        out = torch.addmm(bias, x, weight.T) if bias is not None else x @ weight.T
        out.addmm_(down, lora_b.T, alpha=scaling)
        ctx.save_for_backward(x, weight, lora_a, lora_b, down)
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, lora_a, lora_b, down = ctx.saved_tensors
        scaling: float = ctx.scaling
        grad = grad.to(x.dtype)
        grad_down = (grad @ lora_b).mul_(scaling)  # [N, r]
        needs_x, _, _, needs_a, needs_b, _ = ctx.needs_input_grad
        grad_b = (grad.T @ down).mul_(scaling) if needs_b else None
        grad_a = grad_down.T @ x if needs_a else None
        grad_x = (grad @ weight).addmm_(grad_down, lora_a) if needs_x else None
        return grad_x, None, None, grad_a, grad_b, None


def _fusable(layer: LoraLinear, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The adapter this call can run fused, or None where peft's own forward must run it."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = layer.active_adapters
    if len(active) != 1 or active[0] not in layer.lora_A or active[0] in layer.lora_variant:
        return None
    name: str = active[0]
    base = layer.base_layer
    if (
        type(base) is not torch.nn.Linear
        or base.weight.requires_grad
        or (base.bias is not None and base.bias.requires_grad)
        or not isinstance(layer.lora_dropout[name], torch.nn.Identity)
        or layer.lora_B[name].bias is not None
    ):
        return None
    return name


def _fused_forward(layer: LoraLinear, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    name = _fusable(layer, args, kwargs)
    if name is None:
        result: torch.Tensor = type(layer).forward(layer, x, *args, **kwargs)
        return result
    base = layer.base_layer
    assert isinstance(base, torch.nn.Linear)
    device = x.device.type
    # the dtype autocast would give each of the three products (it casts inputs to its own), else x's
    dtype = product_dtype(device, x.dtype)
    with torch.autocast(device, enabled=False):
        flat = x.to(dtype).reshape(-1, x.shape[-1])  # a view of x where x already has that dtype
        out: torch.Tensor = _LoraProduct.apply(  # type: ignore[no-untyped-call]
            flat,
            base.weight.to(dtype),
            None if base.bias is None else base.bias.to(dtype),
            layer.lora_A[name].weight.to(dtype),
            layer.lora_B[name].weight.to(dtype),
            float(layer.scaling[name]),
        )
    return out.view(*x.shape[:-1], out.shape[-1])


def fuse_lora(model: torch.nn.Module) -> int:
    """Route each peft LoRA ``Linear`` of ``model`` through ``_fused_forward``; returns how many."""
    layers = [module for module in model.modules() if isinstance(module, LoraLinear)]
    for layer in layers:
        layer.forward = types.MethodType(_fused_forward, layer)  # type: ignore[method-assign]
    return len(layers)
