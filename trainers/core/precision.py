"""Which dtype training computes in: a job's ``mixed_precision`` setting as an autocast dtype, and, inside
a forward or backward, the dtype a product's inputs take at that moment (what our own kernels, which
turn autocast off around their products, must cast to themselves)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from peft import PeftModel
from peft.helpers import disable_input_dtype_casting

from trainers.registry import choices

PRECISIONS = choices("supervised", "mixed_precision")


def autocast_dtype(mixed_precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast compute dtype, or None for plain fp32.

    On CUDA: ``auto`` is bf16 where the GPU has it, ``bf16`` and ``fp16`` are what they say. On the CPU
    only an explicit ``bf16`` autocasts (to bf16): it pays on CPUs with bf16 matrix instructions
    (AVX512-BF16, AMX), and it changes the numbers, so ``auto`` stays fp32 there. ``fp16`` on the CPU
    trains in fp32: CPUs have no fast fp16 products for training."""
    if mixed_precision not in PRECISIONS:
        raise ValueError(f"mixed_precision must be one of {PRECISIONS}, not {mixed_precision!r}")
    if mixed_precision == "no":
        return None
    if device.type != "cuda":
        return torch.bfloat16 if mixed_precision == "bf16" else None
    if mixed_precision == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if mixed_precision == "bf16" else torch.float16


def product_dtype(device_type: str, otherwise: torch.dtype) -> torch.dtype:
    """The dtype a matrix product on ``device_type`` computes in here: autocast's, where it is enabled (it
    casts the product's inputs to it), else ``otherwise`` (the inputs' own, or what the caller computes
    in without autocast)."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return otherwise


@contextmanager
def computing_in(model: torch.nn.Module, dtype: torch.dtype | None, device: torch.device) -> Iterator[None]:
    """The model's forwards under autocast to ``dtype`` (none: as they are). Its LoRA layers then take
    their inputs as they come: peft casts a LoRA layer's input to the adapter's dtype (fp32) and autocast
    casts it back for the product, an exact round trip that cost a SmolLM2 step one copy of every
    adapted layer's input, and kept the copy for backward in place of the input itself (which
    ``trainers.kernels.activation_memory`` then could not rebuild instead of keeping)."""
    if dtype is None:
        yield
        return
    with (
        torch.autocast(device.type, dtype=dtype),
        disable_input_dtype_casting(model, isinstance(model, PeftModel)),
    ):
        yield
