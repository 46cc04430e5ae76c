"""The one call that switches a training process's kernels on, with the job's settings.

Loading a model (``trainers.modeling.loading``) installs nothing: a method's train function calls
``install_kernels`` once on the model it loaded (``trainers.families.entry.load_model_to_train``), so
what runs differently from stock transformers and peft is visible where the run starts:

- LoRA layers: base and adapter products as one autograd function (``fused_lora``);
- activation memory: gradient checkpointing when asked for, else each decoder layer keeps only the
  activations that are costly to recompute (``activation_memory``);
- attention: on CUDA no cuDNN plans and packed rows through flash attention's variable-length kernel
  (``varlen_attention``); on a CPU, training attention through ``cpu_attention``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from peft import PeftModel
from transformers import PreTrainedModel

from trainers.kernels import cpu_attention, varlen_attention
from trainers.kernels.activation_memory import save_less_activation
from trainers.kernels.fused_lora import fuse_lora


class KernelSettings(Protocol):
    gradient_checkpointing: bool


def install_kernels(
    model: torch.nn.Module, settings: KernelSettings, device: torch.device
) -> torch.nn.Module:
    """Install the job's kernels on ``model`` (and this process's attention switches); returns ``model``."""
    if isinstance(model, PeftModel):
        fuse_lora(model)
    _reduce_activation_memory(model, settings)
    use_attention_kernels(device)
    return model


def use_plan_free_attention(device: torch.device) -> None:
    """On CUDA, keep sdpa off cuDNN's attention: cuDNN builds an execution plan for every new sequence
    length, and a training run's micro-batches are padded to their own longest row, so nearly every step
    is a new length. On a GPU that planning made a DPO step of SmolLM2's shapes ~3x longer than its GPU
    work (CPU-bound); the flash and memory-efficient kernels
    sdpa falls back to need none. This process trains one job, so the global switch is its own."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def use_attention_kernels(device: torch.device) -> None:
    """A trainer process's attention: on CUDA, no cuDNN (``use_plan_free_attention``), and packed
    sequences through flash attention's variable-length kernel where this torch has it
    (``trainers.kernels.varlen_attention``: ~1.2x the tokens/s for full SFT of a 0.5B model); on a CPU,
    bf16 training attention's backward as batched products (``trainers.kernels.cpu_attention``)."""
    use_plan_free_attention(device)
    if varlen_attention.available(device):
        varlen_attention.install()
    elif device.type == "cpu" and not varlen_attention.installed():  # (tests install it on a CPU)
        cpu_attention.install()


def _reduce_activation_memory(model: torch.nn.Module, settings: KernelSettings) -> None:
    """Gradient checkpointing when asked for (recompute each layer in backward); otherwise each decoder
    layer keeps only the activations that are costly to recompute (``trainers.kernels.activation_memory``),
    for
    a few elementwise passes per layer rather than a layer's forward."""
    if settings.gradient_checkpointing:
        _enable_gradient_checkpointing(model)
    else:
        save_less_activation(model)


def _enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    assert isinstance(base, PreTrainedModel)
    # Non-reentrant checkpointing works with frozen inputs; input grads are enabled anyway for
    # models whose layers still use the reentrant variant.
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5 renamed the method
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[no-untyped-call]
    base.config.use_cache = False
    if isinstance(model, PeftModel):
        base.enable_input_require_grads()  # type: ignore[no-untyped-call]
