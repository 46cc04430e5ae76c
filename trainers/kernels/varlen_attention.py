"""Packed sequences' attention through flash attention's variable-length kernel, on CUDA.

A packed row holds several sequences (``trainers.data.packing``). Given only their position ids, transformers
builds a block-diagonal causal mask for sdpa, and a mask sends sdpa to its memory-efficient kernel, which
computes every block of every row's W x W scores, those across sequences too. Flash attention's
variable-length kernel (``torch.nn.attention.varlen``) takes the sequences' bounds instead and computes
each sequence's own causal triangle. On an H200, full SFT of a 0.5B model at 64 rows of up to 1,024
tokens spent 17% of its GPU time in the memory-efficient kernel (git log -p docs/benchmarks.md).

How it reaches the model: a caller that knows its sequences passes their bounds as transformers'
standard keyword arguments (``sequence_starts``, ``attention_kwargs``), which the decoder hands every
attention call. ``install`` puts ``attention_forward`` in transformers' registry under "sdpa": with those
arguments, on a device in ``VARLEN_DEVICES``, it runs the variable-length kernel; otherwise transformers'
own sdpa, unchanged (generation, the pair methods' shared-prompt masks, every CPU run). Replacing the
registry's entry is process-wide: a trainer process trains one job, so the switch is its own (as
``trainers.kernels.install.use_plan_free_attention``'s).

The kernel is CUDA's only. ``segment_attention``'s CPU branch computes the same thing sequence by
sequence with sdpa, so that tests on a CPU check everything but the kernel call: the bounds, the layout
of queries, keys and values, grouped-query heads, and that the bounds reach every layer.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from trainers.core.precision import product_dtype

_VarlenAttention = Callable[..., Any]
try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    varlen_attn: _VarlenAttention | None = _varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None

# where `attention_forward` takes the variable-length path; tests add "cpu" to run its CPU branch
VARLEN_DEVICES: frozenset[str] = frozenset({"cuda"})


def sequence_starts(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The bounds of the sequences in packed rows whose ``position_ids`` [R, W] restart at 0 for each
    (a row's padded tail too): the [S + 1] cumulative sequence starts over the flattened R * W tokens
    (int32), and the longest sequence. Computed where the ids are (the CPU, in collation), so that the
    training step waits on no device for them."""
    flat = position_ids.flatten()
    starts = torch.nonzero(flat == 0).flatten()
    cumulative = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    return cumulative, int((cumulative[1:] - cumulative[:-1]).max())


def attention_kwargs(starts: torch.Tensor, longest: int) -> dict[str, Any]:
    """``sequence_starts``'s bounds as the keyword arguments transformers' decoders hand every attention
    call (its names for packed attention)."""
    return {
        "cu_seq_lens_q": starts,
        "cu_seq_lens_k": starts,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: torch.Tensor,
    longest: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention within each sequence of packed tokens: ``query`` [N, Hq, D], ``key``/``value``
    [N, Hkv, D] (Hq a multiple of Hkv), ``bounds`` the [S + 1] cumulative starts; [N, Hq, D]."""
    if query.device.type == "cuda":
        return _flash_varlen(query, key, value, bounds, longest, scale)
    groups = query.shape[1] // key.shape[1]
    pieces = []
    for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # [H, n, D]
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        pieces.append(
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(
                0, 1
            )
        )
    return torch.cat(pieces)


def _flash_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: torch.Tensor,
    longest: int,
    scale: float,
) -> torch.Tensor:
    assert varlen_attn is not None
    parameters = _varlen_parameters()
    options: dict[str, Any] = {}
    if "is_causal" in parameters:  # torch 2.10-2.11
        options["is_causal"] = True
    else:  # torch >= 2.12: a window of everything before and nothing after
        options["window_size"] = (-1, 0)
    if "scale" in parameters:
        options["scale"] = scale
    else:  # the kernel's own scale is 1 / sqrt(D)
        query = query * (scale * query.shape[-1] ** 0.5)
    if "enable_gqa" in parameters:
        options["enable_gqa"] = True
    elif key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out: torch.Tensor = varlen_attn(query, key, value, bounds, bounds, longest, longest, **options)
    return out


@functools.cache
def _varlen_parameters() -> frozenset[str]:
    """The keyword arguments this torch's ``varlen_attn`` takes (its signature changed in 2.12)."""
    return frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else frozenset()


def _kernel_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The dtype the variable-length path computes in: sdpa's under an enabled autocast (it casts its
    inputs down, and a Llama's rotary embedding hands it float32 queries even under bf16 autocast), else
    the queries' own; None where the CUDA kernel cannot take it (it takes fp16 and bf16 only)."""
    device = query.device.type
    dtype = product_dtype(device, query.dtype)
    if device == "cuda" and dtype not in (torch.float16, torch.bfloat16):
        return None
    return dtype


# what a layer may ask of its attention beyond causal attention within each sequence, which the kernel
# does not do: a sliding window (Gemma 3's and gpt-oss's local layers, Mistral), soft-capped scores
# (Gemma 2), attention sinks (gpt-oss). Such a call takes sdpa, under the mask transformers built for it
BEYOND_CAUSAL = ("sliding_window", "softcap", "s_aux")


def _takes_varlen(
    module: torch.nn.Module, query: torch.Tensor, dropout: float, kwargs: dict[str, Any]
) -> bool:
    return (
        kwargs.get("cu_seq_lens_q") is not None
        and query.device.type in VARLEN_DEVICES
        and (varlen_attn is not None or query.device.type != "cuda")
        and _kernel_dtype(query) is not None
        and dropout == 0.0
        and getattr(module, "is_causal", True)
        and all(kwargs.get(name) is None for name in BEYOND_CAUSAL)
    )


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (``query`` [B, Hq, T, D], ``key``/``value`` [B, Hkv, T,
    D]; returns [B, T, Hq, D]). With sequence bounds on a ``VARLEN_DEVICES`` device: each packed sequence
    attends causally within itself (the mask, which says the same, is not read). Else transformers' sdpa."""
    if not _takes_varlen(module, query, dropout, kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, width, dim = query.shape
    scale = scaling if scaling is not None else dim**-0.5

    dtype = _kernel_dtype(query)

    def tokens(t: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [B * T, H, D]
        return t.transpose(1, 2).reshape(batch * width, t.shape[1], dim).to(dtype)

    out = segment_attention(
        tokens(query), tokens(key), tokens(value), kwargs["cu_seq_lens_q"], kwargs["max_length_q"], scale
    )
    return out.view(batch, width, heads, dim), None


_SDPA: Callable[..., Any] = sdpa_attention_forward


def install() -> None:
    """Route transformers' "sdpa" attention through ``attention_forward`` in this process."""
    AttentionInterface.register("sdpa", attention_forward)


def installed() -> bool:
    """Whether this process's "sdpa" is ``attention_forward``: only then do callers pass sequence bounds
    (a model whose forward takes no extra keyword arguments would reject them)."""
    return AttentionInterface._global_mapping.get("sdpa") is attention_forward


def uninstall() -> None:
    """Give "sdpa" back to transformers' own function (for tests)."""
    AttentionInterface.register("sdpa", _SDPA)


def available(device: torch.device) -> bool:
    """Whether the variable-length kernel runs on ``device``."""
    return device.type == "cuda" and varlen_attn is not None
