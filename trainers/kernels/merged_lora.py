"""Sampling through LoRA weights merged into their base layers, and the base restored exactly after.

A LoRA layer's forward is three products (the base's, then the rank-r ``A`` and ``B``) plus peft's
bookkeeping around them. In a training step's forward that is cheap next to the base product of many
rows, but a rollout's decoding step runs every layer on a few rows, where those extra products and the
Python around them cost as much as the base product (git log -p docs/benchmarks.md). Merged, a layer is one
product of ``W + scale · B A``, which is what peft's ``merge_adapter`` computes; its ``unmerge``
subtracts the delta again, which in bf16 (or even fp32) does not give back the same bits, and a frozen
base that drifts a rounding error per rollout is no longer frozen. So the merged weight is a new
tensor put in place of the base's for the block, and the base's own tensor, never written to, is put
back: one extra copy of the adapted weights while sampling, none while training.

The sampled ids differ from the unmerged model's only by the merged weight's rounding; the log-probs
every loss uses come from the training forwards, not from sampling.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from peft import PeftModel
from peft.tuners.lora import Linear as LoraLinear
from torch.distributed.tensor import DTensor


def _mergeable(model: torch.nn.Module) -> list[LoraLinear]:
    """The LoRA linear layers to merge, or none where merging does not apply: not a LoRA model, an
    adapter already merged or disabled, DoRA (its scale depends on the merged weight's norm), or
    weights sharded across ranks (FSDP: a shard's delta would need the whole of ``A`` and ``B``)."""
    if not isinstance(model, PeftModel):
        return []
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    for layer in layers:
        weight = _base_weight(layer)
        if (
            layer.merged
            or layer.disable_adapters
            or any(layer.use_dora.get(a, False) for a in layer.active_adapters)
            or isinstance(weight, DTensor)
            or any(isinstance(p, DTensor) for p in layer.lora_A.parameters())
        ):
            return []
    return layers


def _base_weight(layer: LoraLinear) -> torch.Tensor:
    weight = layer.get_base_layer().weight
    assert isinstance(weight, torch.Tensor)
    return weight


@contextmanager
def merged_lora(model: torch.nn.Module) -> Iterator[None]:
    """For the block, each active LoRA adapter of ``model`` merged into its base layer's weight (the
    forwards then skip the adapter's products), under ``torch.no_grad``; the base weights are the same
    tensors, bit for bit, afterwards. A model it does not apply to (``_mergeable``) runs as it is."""
    originals: list[tuple[LoraLinear, torch.Tensor, list[str]]] = []
    try:
        with torch.no_grad():
            for layer in _mergeable(model):
                weight = _base_weight(layer)
                adapters = [a for a in layer.active_adapters if a in layer.lora_A]
                combined = weight.data.clone()
                for adapter in adapters:
                    combined += layer.get_delta_weight(adapter).to(weight.dtype)
                originals.append((layer, weight.data, layer.merged_adapters))
                weight.data = combined
                # peft's own mark of a merged layer: its forward then runs the base layer alone
                layer.merged_adapters = adapters
            yield
    finally:
        for layer, original, marks in originals:
            _base_weight(layer).data = original
            layer.merged_adapters = marks
