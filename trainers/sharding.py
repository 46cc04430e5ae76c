"""FSDP (``resources.strategy: "fsdp"``): each rank holds a shard of the weights, gradients and optimizer
state, with torch's ``fully_shard`` (FSDP2) doing the gathering and the reduce-scatter.

What changes against DDP (``trainers/distributed.py``), and why:

- ``shard_model``: each decoder layer (the model's ``_no_split_modules``) is one FSDP unit and the rest
  of the model (embeddings, final norm, LM head; tied weights stay together) the root unit. A unit's
  weights are gathered for its forward and backward and freed after.
- Every forward is a collective (the gather), so every rank runs the same number of forwards and
  backwards in a step and in a validation pass: a rank with fewer micro-batches runs a stand-in one
  whose loss counts zero (``trainers.loop``).
- FSDP averages gradients over the ranks; the loop sums them (the step's loss is a sum over all ranks'
  units divided by their number), so under FSDP each rank's loss is multiplied by the world size
  (``GRADIENT_SCALE``): the mean of W·g_r is Σ g_r, exactly, as W is a power of two or the sum is
  rounded once either way.
- The chunked LM head (``modeling.decoder_and_head``) reads the head's weight outside a forward, where
  FSDP keeps it sharded: sharded models run the whole model instead.
- A checkpoint is the same as a DDP or one-process one: rank 0 writes the full weights
  (``full_model_state``) and the full optimizer state (``full_optimizer_state``), gathered from every
  rank; a resumed run on any number of ranks, sharded or not, reads it back (``shard_optimizer_state``).

The online methods sample with ``generate``, one forward per token and a different number of tokens on
each rank; they are refused with FSDP (501) until generation gathers the weights once per rollout.
"""

from __future__ import annotations

from typing import Any

import torch
from peft import PeftModel
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import PreTrainedModel

from trainers import distributed as dist


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def shard_model(model: torch.nn.Module, device: torch.device) -> None:
    """Shard ``model`` in place over every rank: one FSDP unit per decoder layer, the root for the rest."""
    mesh = init_device_mesh(device.type, (dist.world_size(),))
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    layer_types = set(getattr(base, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_types:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def gradient_scale(model: torch.nn.Module) -> float:
    """What each rank's loss is multiplied by so that FSDP's averaged gradients are the ranks' sum."""
    return float(dist.world_size()) if is_sharded(model) else 1.0


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights of a sharded model, on rank 0's CPU (empty on the other ranks); every rank calls
    it (a collective)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each sharded tensor gathered whole (every rank calls it): the
    layout a one-process run saves, so the checkpoint resumes on any number of ranks."""
    state = optimizer.state_dict()
    state["state"] = {
        index: {
            key: value.full_tensor().cpu() if isinstance(value, DTensor) else value
            for key, value in entries.items()
        }
        for index, entries in state["state"].items()
    }
    return state


def shard_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state (``full_optimizer_state``'s) cut into this rank's shards of its parameters,
    ready for ``optimizer.load_state_dict``; every rank reads the same full state."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = dict(state)
    out["state"] = {
        index: {key: _like(params[int(index)], value) for key, value in entries.items()}
        for index, entries in state["state"].items()
    }
    return out


def _like(param: torch.Tensor, value: Any) -> Any:
    """``value`` (a full per-parameter state tensor) sharded like ``param``; scalars (AdamW's step) as
    they are."""
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return value
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)


def unsharded_copy(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain (unsharded) copy of ``model`` holding ``state`` (``full_model_state``'s), built on rank 0
    to export a final checkpoint: the LoRA merge and ``save_pretrained`` need whole weights."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    assert isinstance(base, PreTrainedModel)
    with torch.device("meta"):
        copy: torch.nn.Module = type(base)(base.config)
    if isinstance(model, PeftModel):
        from peft import get_peft_model

        copy = get_peft_model(copy, model.peft_config["default"])
    copy.load_state_dict(state, assign=True)
    return copy
