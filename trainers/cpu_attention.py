"""Training attention on a CPU in bf16: sdpa's flash forward, and a backward of batched products.

On a CPU, sdpa's flash kernel takes five times as long for backward as for forward (SmolLM2's bench
batches on a Xeon with AMX: 21 ms against 4.5 ms a layer, 19% of an SFT LoRA step). Its backward walks
the scores in small tiles; where the CPU multiplies bf16 matrices in hardware (AMX), batched products
over a block of query rows at a time do the same work sooner. ``_BlockedAttention`` keeps sdpa's
flash forward (the same kernel, so the same outputs) and its log-sum-exp, and in backward, for each
block of ``BLOCK_ROWS`` query rows:

- the scores ``q k^T`` against the keys up to the block's last allowed one (a causal block skips the
  keys after it), as ``bmm`` in bf16, then in float32 less the forward's log-sum-exp, masked, and
  ``exp``: the softmax, without a second normalisation pass;
- ``dV += P^T dO``, ``dP = dO V^T``, ``dS = P (dP - rowsum(dO * O))``, ``dQ = dS K``, ``dK += dS^T Q``.

Grouped key/value heads are handled by grouping the query heads of one key head as rows, never by
repeating keys and values. Masked scores are set to -80 before ``exp`` and their weights to 0 after
it: an ``exp`` of -inf, or of anything whose result underflows, took 6x as long as of an ordinary value
on that CPU. The scores are rounded to bf16 by the product, as transformers' eager attention rounds
them; the gradients stay within twice the flash kernel's distance from a float32 reference
(tests/trainers/test_cpu_attention.py).

Where it runs: ``attention_forward`` takes transformers' "sdpa" attention calls of a trainer process
(``install``) when the call is a training one on a CPU in bf16 (grad enabled, no dropout, causal or
under a mask as long as the keys, boolean or additive with 0 where a query attends); everything else
goes to ``varlen_attention.attention_forward``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_utils import AttentionInterface

from trainers import varlen_attention
from trainers.precision import product_dtype

# query rows a backward block takes: at 128-150 rows the float32 scores of a block stay in the caches
# (one block of all 295 rows took 32 ms against 11 ms in two blocks; 512 rows: 31 ms in four, 57 in two)
BLOCK_ROWS = 128
# what a masked score becomes before exp (its weight is set to 0 after): a value exp computes at full speed
MASKED_SCORE = -80.0


class _BlockedAttention(torch.autograd.Function):
    """Attention of ``query`` [B, H, T, D] over ``key``/``value`` [B, Hkv, T, D] (H a multiple of Hkv),
    causal or under ``mask`` ([B or 1, 1, T, T], True where a query may attend); [B, H, T, D]."""

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
        if mask is not None and additive is None:  # the kernel takes a mask added to the scores
            additive = _additive(mask, query.dtype)
        out: torch.Tensor
        lse: torch.Tensor
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, mask is None, attn_mask=additive, scale=scale
        )
        ctx.save_for_backward(query, key, value, out, lse, mask)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
        query, key, value, out, lse, mask = ctx.saved_tensors
        scale: float = ctx.scale
        batch, heads, width, dim = query.shape
        kv_heads = key.shape[1]
        groups = heads // kv_heads
        grouped = (batch, kv_heads, groups, width)
        scaled = (query * scale).view(*grouped, dim)
        grad = grad.to(query.dtype).contiguous().view(*grouped, dim)
        delta = (grad.float() * out.float().view(*grouped, dim)).sum(-1)  # rowsum(dO * O)
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
    """A layer call's mask as the blocked path takes it: where queries attend, and the same as an additive
    mask in the compute dtype for the flash forward. transformers hands every layer of a forward the same
    mask tensor, so the last one's conversion is kept and reused while that tensor is unchanged."""

    def __init__(self, source: torch.Tensor, allowed: torch.Tensor, additive: torch.Tensor) -> None:
        self.source, self.version = source, source._version
        self.allowed, self.additive = allowed, additive

    def of(self, mask: torch.Tensor, dtype: torch.dtype) -> bool:
        return mask is self.source and mask._version == self.version and self.additive.dtype == dtype


_last_mask: _Mask | None = None


def _blocked_mask(mask: torch.Tensor, dtype: torch.dtype) -> _Mask | None:
    """``mask`` as the blocked path takes it: a boolean one as it is; an additive one (the pair methods'
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
    _last_mask = _Mask(mask, allowed, _additive(allowed, dtype))
    return _last_mask


def _blocked_call(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> tuple[bool, _Mask | None]:
    """Whether this call takes the blocked path, and its mask as that path takes it (None: causal)."""
    if query.device.type != "cpu" or dropout != 0.0 or not torch.is_grad_enabled():
        return False, None
    if not (query.requires_grad or key.requires_grad) or product_dtype("cpu", query.dtype) != torch.bfloat16:
        return False, None
    width = query.shape[2]
    if width < 2 or key.shape[2] != width or query.shape[1] % key.shape[1] != 0:
        return False, None
    if any(kwargs.get(name) is not None for name in ("position_bias", "cache", "softcap", "is_causal")):
        return False, None
    if mask is None:
        return bool(getattr(module, "is_causal", True)), None
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != width:
        return False, None
    converted = _blocked_mask(mask, torch.bfloat16)
    return converted is not None, converted


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
    """transformers' attention-function signature (returns [B, T, H, D]): a training call on a CPU in
    bf16 through ``_BlockedAttention``, anything else through ``varlen_attention.attention_forward``."""
    blocked, mask = _blocked_call(module, query, key, attention_mask, dropout, kwargs)
    if not blocked:
        return varlen_attention.attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    with torch.autocast("cpu", enabled=False):
        out: torch.Tensor = _BlockedAttention.apply(  # type: ignore[no-untyped-call]
            query.to(torch.bfloat16),
            key.to(torch.bfloat16),
            value.to(torch.bfloat16),
            None if mask is None else mask.allowed,
            scale,
            None if mask is None else mask.additive,
        )
    return out.transpose(1, 2).contiguous(), None


def install() -> None:
    """Route transformers' "sdpa" attention through ``attention_forward`` in this process (a trainer
    process trains one job, so the switch is its own, as ``varlen_attention.install``'s)."""
    AttentionInterface.register("sdpa", attention_forward)


def installed() -> bool:
    return AttentionInterface._global_mapping.get("sdpa") is attention_forward
