"""Activation memory: what backward keeps of a decoder layer, and what it can compute again instead.

Autograd keeps every tensor an operation needs for its gradient until backward has used it. In a
Llama-style layer, some of those are cheap to recompute from others that backward keeps anyway:

- the gated MLP ``down(silu(gate(x)) * up(x))`` keeps four [tokens, intermediate] tensors: ``gate(x)``
  (for SiLU's backward), ``silu(gate(x))`` and ``up(x)`` (for the product's) and the product (for the
  gradient of ``down``'s weight, or of its LoRA ``A``). ``silu_mul`` keeps only ``gate(x)`` and
  ``up(x)``, and the product is rebuilt from them when ``down`` needs it;
- an RMSNorm's output (kept by the projections it feeds) and its normalised input (kept for the
  gradient of its weight, when that trains) are rebuilt from its input and the per-token
  reciprocal RMS, which it keeps anyway.

For SmolLM2 with LoRA that is ~40% of a layer's saved activations, for a few elementwise passes more
in backward. ``save_less_activation`` installs it on the architectures whose MLP and RMSNorm forwards
are exactly transformers' Llama ones, or Phi-3's MLP with its gate and up in one projection
(``RECOMPUTING_MODELS``). Not under gradient checkpointing, which
drops a layer's activations altogether; a recipe would keep the tensors it reads alive.

How: each decoder layer's forward runs in a ``_RecomputeScope``, whose saved-tensor hooks replace a
tensor registered with ``recompute`` (or a contiguous view of all of it, as ``linear`` keeps a 3-D input
flattened) by a ``_Recipe`` that computes it once when backward first asks for it.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import PreTrainedModel

from trainers.architectures import model_types

# transformers architectures whose decoder layers' MLP forward is ``down_proj(act_fn(gate_proj(x)) *
# up_proj(x))`` (Phi-3: gate and up one projection) and whose RMSNorm is Llama's
# (``Architecture.llama_layers``); the others keep transformers' forwards
RECOMPUTING_MODELS = model_types(llama_layers=True)


class _SiluMul(torch.autograd.Function):
    """``silu(gate) * up`` that saves its two inputs only. ``shared`` may hand backward ``silu(gate)``
    under ``"silu"``, computed by whoever rebuilt the product just before (``_gated_mlp_forward``)."""

    @staticmethod
    def forward(
        ctx: Any, gate: torch.Tensor, up: torch.Tensor, shared: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.shared = shared
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        # as few passes over [tokens, intermediate] as autograd's own SiLU and product take: on a CPU
        # these elementwise passes are bound by memory bandwidth, not arithmetic
        gate, up = ctx.saved_tensors
        silu = ctx.shared.pop("silu", None)
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        grad_up = (F.silu(gate) if silu is None else silu).mul_(grad)
        return grad_gate, grad_up, None


def silu_mul(
    gate: torch.Tensor, up: torch.Tensor, shared: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    out: torch.Tensor = _SiluMul.apply(gate, up, {} if shared is None else shared)  # type: ignore[no-untyped-call]
    return out


class _Recipe:
    """What autograd keeps instead of a registered tensor: how to compute it again, computed once in
    backward and shared by every operation that saved the tensor (the q, k and v projections all save
    the norm's output), so it lives from the first of their backwards to the last, as the tensor would."""

    def __init__(self, compute: Callable[[], torch.Tensor]) -> None:
        self.compute = compute
        self.value: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        if self.value is None:
            with torch.no_grad():
                self.value = self.compute()
        return self.value


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


class _RecomputeScope:
    """Registered tensors by storage. A registered tensor stays referenced until the scope closes, so
    its memory cannot be reused by another tensor that would then be taken for it."""

    def __init__(self) -> None:
        self.registered: dict[int, tuple[torch.Tensor, _Recipe]] = {}

    def recompute(self, tensor: torch.Tensor, compute: Callable[[], torch.Tensor]) -> None:
        if tensor.is_contiguous() and tensor.storage_offset() == 0:
            self.registered[tensor.untyped_storage().data_ptr()] = (tensor, _Recipe(compute))

    def pack(self, saved: torch.Tensor) -> torch.Tensor | tuple[_Recipe, torch.Size]:
        if not self.registered or saved.layout != torch.strided or type(saved) not in _PLAIN_TENSORS:
            return saved  # (a tensor subclass may have no storage of its own)
        found = self.registered.get(saved.untyped_storage().data_ptr())
        if found is None:
            return saved
        tensor, recipe = found
        if (
            saved.storage_offset() == 0
            and saved.numel() == tensor.numel()
            and saved.dtype == tensor.dtype
            and saved.is_contiguous()
        ):
            return recipe, saved.shape
        return saved

    @staticmethod
    def unpack(packed: torch.Tensor | tuple[_Recipe, torch.Size]) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        recipe, shape = packed
        return recipe().view(shape)


_open = threading.local()  # this thread's innermost open scope


@contextmanager
def recompute_scope() -> Iterator[_RecomputeScope]:
    """Inside this block, a tensor given to ``recompute`` is saved as its recipe."""
    scope, outer = _RecomputeScope(), getattr(_open, "scope", None)
    _open.scope = scope
    try:
        # every saved tensor keeps these hooks, so the scope's registered tensors are released when
        # the block ends (below), not when backward has run
        with torch.autograd.graph.saved_tensors_hooks(scope.pack, _RecomputeScope.unpack):
            yield scope
    finally:
        scope.registered.clear()
        _open.scope = outer


def recompute(tensor: torch.Tensor, compute: Callable[[], torch.Tensor]) -> None:
    """Have autograd keep ``compute`` rather than ``tensor`` inside the open ``recompute_scope`` (no-op
    outside one). ``compute`` must return ``tensor``'s values from tensors that backward keeps anyway."""
    scope: _RecomputeScope | None = getattr(_open, "scope", None)
    if scope is not None and torch.is_grad_enabled():
        scope.recompute(tensor, compute)


def _gate_and_up(mlp: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated MLP's two projections of ``x``: a LlamaMLP's two, or Phi-3's one fused ``gate_up_proj``
    (the gate its first half), as views of its output."""
    if hasattr(mlp, "gate_up_proj"):
        gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
        return gate, up
    return mlp.gate_proj(x), mlp.up_proj(x)


def _gated_mlp_forward(mlp: Any, x: torch.Tensor) -> torch.Tensor:  # a transformers LlamaMLP or Phi3MLP
    gate, up = _gate_and_up(mlp, x)
    out: torch.Tensor
    if not torch.is_grad_enabled():
        out = mlp.down_proj(F.silu(gate) * up)
        return out
    shared: dict[str, torch.Tensor] = {}
    product = silu_mul(gate, up, shared)

    def rebuilt() -> torch.Tensor:
        # down's backward asks for the product right before silu_mul's backward runs: hand it the SiLU
        shared["silu"] = F.silu(gate)
        return shared["silu"] * up

    recompute(product, rebuilt)
    out = mlp.down_proj(product)
    return out


def _rms_norm_forward(norm: Any, hidden_states: torch.Tensor) -> torch.Tensor:  # a LlamaRMSNorm
    # transformers' LlamaRMSNorm, operation for operation (same values), with its two products registered
    input_dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    inverse_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    normalised = x * inverse_rms
    if norm.weight.requires_grad:  # only a trained weight's gradient keeps it (LoRA's norms are frozen)
        recompute(normalised, lambda: x * inverse_rms)  # before the product below saves it
    out: torch.Tensor = norm.weight * normalised.to(input_dtype)
    recompute(out, lambda: norm.weight * (x * inverse_rms).to(input_dtype))
    return out


def _layer_forward(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    with recompute_scope():
        return type(layer).forward(layer, *args, **kwargs)


def save_less_activation(model: torch.nn.Module) -> int:
    """Install the above on each decoder layer of ``model`` (a transformers model of
    ``RECOMPUTING_MODELS`` with a SiLU MLP, under a LoRA wrapper or not); returns how many layers got it
    (0 for other models, which keep transformers' forwards)."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    if not isinstance(base, PreTrainedModel):
        return 0
    config = base.config.get_text_config()
    if config.model_type not in RECOMPUTING_MODELS or config.hidden_act != "silu":
        return 0
    decoder = base.get_decoder()  # type: ignore[no-untyped-call]
    layers = list(decoder.layers)
    for layer in layers:
        layer.forward = types.MethodType(_layer_forward, layer)
        layer.mlp.forward = types.MethodType(_gated_mlp_forward, layer.mlp)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.forward = types.MethodType(_rms_norm_forward, norm)
    return len(layers)
