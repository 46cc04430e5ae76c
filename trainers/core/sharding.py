"""FSDP (``resources.strategy: "fsdp"``): each rank holds a shard of the weights, gradients and optimizer
state, with torch's ``fully_shard`` (FSDP2) doing the gathering and the reduce-scatter.

What changes against DDP (``trainers/core/distributed.py``), and why:

- ``shard_model``: each decoder layer (the model's ``_no_split_modules``) is one FSDP unit and the rest
  of the model (embeddings, final norm, LM head; tied weights stay together) the root unit. A unit's
  weights are gathered for its forward and backward and freed after.
- Every forward is a collective (the gather), so every rank runs the same number of forwards and
  backwards in a step and in a validation pass: a rank with fewer micro-batches runs stand-in ones
  whose loss counts zero (``trainers.core.loop``).
- FSDP averages gradients over the ranks; the loop sums them (the step's loss is a sum over all ranks'
  units divided by their number), so under FSDP each rank's loss is multiplied by the world size
  (the mean of W·g_r is Σ g_r).
- The chunked LM head (``modeling.decoder_and_head``) reads the head's weight outside a forward, where
  FSDP keeps it sharded: sharded models run the whole model instead.
- The online methods sample inside ``gathered``: the weights whole for the rollout (``generate`` runs
  one forward per token, a different number on each rank), sharded again for the optimizer steps. PPO's
  value head is a unit of its own.
- A checkpoint is the same as a DDP or one-process one: rank 0 writes the full weights
  (``full_model_state``) and the full optimizer state (``full_optimizer_state``), gathered from every
  rank; a resumed run on any number of ranks, sharded or not, reads it back (``shard_optimizer_state``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from peft import PeftModel, get_peft_model
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import PreTrainedModel

from trainers.core import distributed as dist


def is_sharded(model: torch.nn.Module) -> bool:
    return _root(model) is not None


def _root(model: torch.nn.Module) -> FSDPModule | None:
    """The outermost FSDP unit of ``model`` (``modules()`` lists a module before its children)."""
    return next((m for m in model.modules() if isinstance(m, FSDPModule)), None)


def shard_model(model: torch.nn.Module, device: torch.device) -> None:
    """Shard ``model`` in place over every rank: one FSDP unit per decoder layer, the root for the rest.

    The root is the Transformers model, inside a peft wrapper: ``generate`` calls its forward, not the
    wrapper's, and FSDP takes the first unit that runs a forward for the root."""
    mesh = init_device_mesh(device.type, (dist.world_size(),))
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    layer_types = set(getattr(base, "_no_split_modules", None) or ())
    for module in base.modules():
        if type(module).__name__ in layer_types:
            fully_shard(module, mesh=mesh)
    fully_shard(base, mesh=mesh)


@contextmanager
def gathered(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Within the block, every sharded unit of ``modules`` holds its whole weights and a forward gathers
    nothing: for sampling (one forward per token, as many as this rank's completions need) and the
    rest of a rollout, which run a different number of forwards on each rank. It costs the whole
    model's memory while it lasts, as sampling with FSDP does elsewhere (TRL gathers the weights for
    generation too); the weights are sharded again after it."""
    units = [m for module in modules for m in module.modules() if isinstance(m, FSDPModule)]
    roots = [root for module in modules if (root := _root(module)) is not None]
    for root in roots:
        root.set_reshard_after_forward(False)  # every unit under it
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for root in roots:
            root.set_reshard_after_forward(True)
            root.set_reshard_after_forward(False, recurse=False)  # a root's own default
        for unit in units:
            unit.reshard()


def load_full_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load whole weights (``full_model_state``'s, read by every rank) into a sharded ``module``."""
    options = StateDictOptions(full_state_dict=True)
    whole: dict[str, Any] = dict(state)
    set_model_state_dict(module, whole, options=options)


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
    for every checkpoint it writes: ``save_pretrained`` and a final checkpoint's LoRA merge need whole
    weights. It shares ``state``'s tensors (``assign``): no second copy of the weights."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    assert isinstance(base, PreTrainedModel)
    # building a model initialises its weights, which draws from the global RNG even on the meta
    # device: only rank 0 builds the copy, and the ranks' RNGs must stay in step (and a resumed run's)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        copy: torch.nn.Module = type(base)(base.config)
        if isinstance(model, PeftModel):
            copy = get_peft_model(copy, model.peft_config["default"])
    copy.load_state_dict(state, assign=True)
    return copy
