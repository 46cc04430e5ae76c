"""Training attention on a CPU: sdpa's flash kernel with less kept for backward, and in bf16 a backward
of batched products.

Both functions here run sdpa's CPU flash kernel forward with grouped key/value heads as they are.
transformers' sdpa path repeats keys and values for every query head whenever it passes sdpa a mask
(padded rows, the pair methods' packed ones), and sdpa keeps the repeated copies for backward: for
SmolLM2 (9 query heads, 3 key/value heads) 3 KiB a token and layer in float32, 0.4 GiB for a reward
model's batch of ~4,800 tokens. sdpa also keeps a float copy of a boolean mask in every layer; here the
layers share one (``_Mask``).

``_FlashAttention`` (float32) runs the kernel's own backward. ``_BlockedAttention`` (bf16) replaces it.
On a CPU, sdpa's flash kernel takes about five times as long for backward as for forward (SmolLM2's
bench batches on a CPU with AMX: a fifth of an SFT LoRA step). Its backward walks
the scores in small tiles; where the CPU multiplies bf16 matrices in hardware (AMX), batched products
over a block of query rows at a time do the same work sooner. For each block of ``BLOCK_ROWS`` query
rows:

- the scores ``q k^T`` against the keys up to the block's last allowed one (a causal block skips the
  keys after it), as ``bmm`` in bf16, then in float32 less the forward's log-sum-exp, masked, and
  ``exp``: the softmax, without a second normalisation pass;
- ``dV += P^T dO``, ``dP = dO V^T``, ``dS = P (dP - rowsum(dO * O))``, ``dQ = dS K``, ``dK += dS^T Q``.

Grouped key/value heads are handled by grouping the query heads of one key head as rows, never by
repeating keys and values. Masked scores are set to -80 before ``exp`` and their weights to 0 after
it: an ``exp`` of -inf, or of anything whose result underflows, took 6x as long as of an ordinary value
on that CPU. The scores are rounded to bf16 by the product, as transformers' eager attention rounds
them; the gradients stay within twice the flash kernel's distance from a float32 reference
(tests/trainers/kernels/test_cpu_attention.py). In float32 the same products were slower than the kernel's
backward on an AVX2-only CPU (~15% slower a layer at the bench's width), so float32 keeps it.

Where it runs: ``attention_forward`` takes transformers' "sdpa" attention calls of a trainer process
(``install``) when the call is a training one on a CPU in bf16 or float32 (grad enabled, no dropout,
causal or under a mask as long as the keys, boolean or additive with 0 where a query attends);
everything else goes to ``varlen_attention.attention_forward``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_utils import AttentionInterface

from trainers.core.precision import product_dtype
from trainers.kernels import varlen_attention

# query rows a backward block takes: at 128-150 rows the float32 scores of a block stay in the caches
# (one block of all 295 rows took ~3x as long as two blocks; 512 rows: four blocks ~2x faster than two)
BLOCK_ROWS = 128
# what a masked score becomes before exp (its weight is set to 0 after): a value exp computes at full speed
MASKED_SCORE = -80.0


class _FlashAttention(torch.autograd.Function):
    """Attention of ``query`` [B, H, T, D] over ``key``/``value`` [B, Hkv, T, D] (H a multiple of Hkv),
    causal or under ``mask`` ([B or 1, 1, T, T], True where a query may attend; ``additive`` the same as
    a float mask added to the scores), through sdpa's CPU flash kernel forward and backward; [B, T, H, D],
    as the layer's output projection takes it. Backward keeps that tensor, which the projection keeps
    anyway (its input). The kernel writes its output in the query's layout: for the model's own queries
    (a [B, T, H, D] tensor seen as [B, H, T, D]) it is the result itself; for queries cast to bf16 it is
    [B, H, T, D], and transformers' path kept it beside the projection's [B, T, H, D] copy."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        additive: torch.Tensor | None = None,
    ) -> torch.Tensor:
        result, lse, additive = _flash_forward(query, key, value, mask, scale, additive)
        ctx.save_for_backward(query, key, value, result, lse, additive)  # what the kernel's backward reads
        ctx.scale = scale
        return result

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
        query, key, value, result, lse, additive = ctx.saved_tensors
        grad_query, grad_key, grad_value = (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad.transpose(1, 2),  # the kernel reads both through their strides: no copy
                query,
                key,
                value,
                result.transpose(1, 2),
                lse,
                0.0,
                additive is None,
                attn_mask=additive,
                scale=ctx.scale,
            )
        )
        return grad_query, grad_key, grad_value, None, None, None


class _BlockedAttention(_FlashAttention):
    """``_FlashAttention``'s forward, and a backward of batched products over blocks of query rows (bf16:
    the module's docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        additive: torch.Tensor | None = None,
    ) -> torch.Tensor:
        result, lse, _ = _flash_forward(query, key, value, mask, scale, additive)
        ctx.save_for_backward(query, key, value, result, lse, mask)  # the blocks read the boolean mask
        ctx.scale = scale
        return result

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
        query, key, value, result, lse, mask = ctx.saved_tensors
        scale: float = ctx.scale
        batch, heads, width, dim = query.shape
        kv_heads = key.shape[1]
        groups = heads // kv_heads
        grouped = (batch, kv_heads, groups, width)
        scaled = (query * scale).view(*grouped, dim)
        grad = grad.to(query.dtype)
        delta = (grad.float() * result.float()).sum(-1).transpose(1, 2).reshape(grouped)  # rowsum(dO * O)
        grad = grad.transpose(1, 2).contiguous().view(*grouped, dim)
        lse = lse.view(grouped)
        grad_query = torch.zeros_like(scaled)
        grad_key = torch.zeros(batch, kv_heads, width, dim)
        grad_value = torch.zeros(batch, kv_heads, width, dim)
        for start in range(0, width, BLOCK_ROWS):
            end = min(start + BLOCK_ROWS, width)
            keys, hidden = _block_keys(mask, start, end)
            if keys == 0:
                continue  # no query of the block attends anywhere: no gradient through it
            rows = groups * (end - start)
            q = scaled[:, :, :, start:end].reshape(batch * kv_heads, rows, dim)
            d_out = grad[:, :, :, start:end].reshape(batch * kv_heads, rows, dim)
            k = key[:, :, :keys].reshape(batch * kv_heads, keys, dim)
            v = value[:, :, :keys].reshape(batch * kv_heads, keys, dim)
            block = (batch, kv_heads, groups, end - start, keys)
            probs = torch.bmm(q, k.transpose(1, 2)).float().view(block)
            probs.sub_(lse[..., start:end, None]).masked_fill_(hidden, MASKED_SCORE).exp_().masked_fill_(
                hidden, 0.0
            )
            in_dtype = probs.to(query.dtype).view(batch * kv_heads, rows, keys)
            grad_value[:, :, :keys] += torch.bmm(in_dtype.transpose(1, 2), d_out).view(
                batch, kv_heads, keys, dim
            )
            scores_grad = torch.bmm(d_out, v.transpose(1, 2)).float().view(block)
            scores_grad.sub_(delta[..., start:end, None]).mul_(probs)
            in_dtype = scores_grad.to(query.dtype).view(batch * kv_heads, rows, keys)
            grad_query[:, :, :, start:end] = torch.bmm(in_dtype, k).view(
                batch, kv_heads, groups, end - start, dim
            )
            grad_key[:, :, :keys] += torch.bmm(in_dtype.transpose(1, 2), q).view(batch, kv_heads, keys, dim)
        return (
            grad_query.mul_(scale).view(batch, heads, width, dim),
            grad_key.to(key.dtype),
            grad_value.to(value.dtype),
            None,
            None,
            None,
        )


def _flash_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    additive: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """sdpa's CPU flash kernel: the output as [B, T, H, D], its log-sum-exp, and the additive mask it ran
    under (built from ``mask`` where none is given)."""
    if mask is not None and additive is None:  # the kernel takes a mask added to the scores
        additive = _additive(mask, query.dtype)
    out: torch.Tensor
    lse: torch.Tensor
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, mask is None, attn_mask=additive, scale=scale
    )
    return out.transpose(1, 2).contiguous(), lse, additive


def _block_keys(mask: torch.Tensor | None, start: int, end: int) -> tuple[int, torch.Tensor]:
    """For the query rows [start, end): how many keys from the first one the block needs (up to its last
    allowed key), and where its scores are masked, as a [B or 1, 1, 1, rows, keys] boolean."""
    if mask is None:  # causal: row i sees keys 0..i
        hidden = torch.ones(end - start, end, dtype=torch.bool).triu_(start + 1)
        return end, hidden.view(1, 1, 1, end - start, end)
    allowed = mask[:, :, start:end]
    seen = allowed.any(dim=2).any(dim=1).any(dim=0).nonzero()
    keys = int(seen.max()) + 1 if seen.numel() else 0
    return keys, ~allowed[..., :keys].unsqueeze(2)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


class _Mask:
    """A layer call's mask as our functions take it: where queries attend, and the same as an additive
    mask in the compute dtype for the flash kernel. transformers hands every layer of a forward the same
    mask tensor, so the last one's conversion is kept and reused while that tensor is unchanged."""

    def __init__(self, source: torch.Tensor, allowed: torch.Tensor, additive: torch.Tensor) -> None:
        self.source, self.version = source, source._version
        self.allowed, self.additive = allowed, additive

    def of(self, mask: torch.Tensor, dtype: torch.dtype) -> bool:
        return mask is self.source and mask._version == self.version and self.additive.dtype == dtype


_last_mask: _Mask | None = None


def _call_mask(mask: torch.Tensor, dtype: torch.dtype) -> _Mask | None:
    """``mask`` as our functions take it: a boolean one as it is; an additive one (the pair methods'
    packed rows) where it is 0, provided every other value masks (below -1e4) rather than biases; else
    None (a bias: sdpa's)."""
    global _last_mask
    if _last_mask is not None and _last_mask.of(mask, dtype):
        return _last_mask
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask == 0
        if not bool((allowed | (mask < -1e4)).all()):
            return None
    # an additive mask of the compute dtype is the kernel's as it is (the pair methods hand every layer
    # the same one, so that every layer keeps that one: trainers/data/packing.py)
    additive = mask if mask.dtype == dtype else _additive(allowed, dtype)
    _last_mask = _Mask(mask, allowed, additive)
    return _last_mask


# the function a CPU training call takes, by the dtype its products compute in (others: sdpa's path)
_FUNCTIONS: dict[torch.dtype, type[_FlashAttention]] = {
    torch.bfloat16: _BlockedAttention,
    torch.float32: _FlashAttention,
}


def _training_call(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> tuple[torch.dtype | None, _Mask | None]:
    """The dtype this call runs in through our functions (None: sdpa's path), and its mask as they take
    it (None: causal)."""
    if query.device.type != "cpu" or dropout != 0.0 or not torch.is_grad_enabled():
        return None, None
    dtype = product_dtype("cpu", query.dtype)
    if not (query.requires_grad or key.requires_grad) or dtype not in _FUNCTIONS:
        return None, None
    width = query.shape[2]
    if width < 2 or key.shape[2] != width or query.shape[1] % key.shape[1] != 0:
        return None, None
    if any(kwargs.get(name) is not None for name in ("position_bias", "cache", "softcap", "is_causal")):
        return None, None
    if mask is None:
        return (dtype if getattr(module, "is_causal", True) else None), None
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != width:
        return None, None
    converted = _call_mask(mask, dtype)
    return (dtype if converted is not None else None), converted


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
    """transformers' attention-function signature (returns [B, T, H, D]): a training call on a CPU through
    ``_BlockedAttention`` in bf16 or ``_FlashAttention`` in float32, anything else through
    ``varlen_attention.attention_forward``."""
    dtype, mask = _training_call(module, query, key, attention_mask, dropout, kwargs)
    if dtype is None:
        return varlen_attention.attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    with torch.autocast("cpu", enabled=False):
        out: torch.Tensor = _FUNCTIONS[dtype].apply(  # type: ignore[no-untyped-call]
            query.to(dtype),
            key.to(dtype),
            value.to(dtype),
            None if mask is None else mask.allowed,
            scale,
            None if mask is None else mask.additive,
        )
    return out, None


def install() -> None:
    """Route transformers' "sdpa" attention through ``attention_forward`` in this process (a trainer
    process trains one job, so the switch is its own, as ``varlen_attention.install``'s)."""
    AttentionInterface.register("sdpa", attention_forward)


def installed() -> bool:
    return AttentionInterface._global_mapping.get("sdpa") is attention_forward
