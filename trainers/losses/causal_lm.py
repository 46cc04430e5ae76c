"""Loss functions: pure functions on tensors.

``token_cross_entropy`` is the causal-LM negative log-likelihood summed over target tokens,
-sum_t log p(x_t | x_<t) (Radford et al. 2018, eq. 1), restricted to positions whose label is not
``IGNORE_INDEX``. It returns sums, not means, so that the caller can normalise by the number of target
tokens in a whole accumulated batch: the same loss whether examples are padded or packed.

``linear_cross_entropy`` is the same loss computed from the final hidden states and the LM head's weight,
chunk by chunk, so that the [N, V] logits of a step's N targets are never held at once (SFT's path on
the architectures ``modeling.decoder_and_head`` knows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainers.core.precision import product_dtype

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenLossSums:
    loss_sum: torch.Tensor  # scalar, float32, differentiable
    n_tokens: int  # target tokens counted
    n_correct: torch.Tensor  # targets that are the argmax of the logits (a scalar: no host sync)


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> TokenLossSums:
    """Summed next-token cross-entropy.

    logits: [B, T, V] for inputs of length T; labels: [B, T], unshifted (``labels[:, t]`` is the target
    predicted from positions < t, as in Hugging Face models), ``IGNORE_INDEX`` where there is no target.
    Only target positions are upcast to float32, so the full [B, T, V] tensor is never copied.
    """
    return next_token_cross_entropy(logits[:, :-1, :], labels[:, 1:])


def target_positions(labels: torch.Tensor) -> torch.Tensor:
    """The positions t (1-D, ascending) whose next token ``labels[:, t + 1]`` is a target in some row: the
    only positions whose logits the loss reads. Pass them as ``logits_to_keep`` so that the LM head runs
    on those hidden states only and [B, T, V] is never materialised; the targets are then
    ``labels[:, positions + 1]``."""
    return (labels[:, 1:] != IGNORE_INDEX).any(dim=0).nonzero().squeeze(-1)


def next_token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> TokenLossSums:
    """Summed cross-entropy of ``logits`` [B, K, V] against ``targets`` [B, K], already aligned (the
    logits at a position against the token that follows it), ``IGNORE_INDEX`` where there is no target."""
    mask = targets != IGNORE_INDEX
    target_logits = logits[mask].float()  # [N, V]
    kept = targets[mask]  # [N]
    loss_sum = F.cross_entropy(target_logits, kept, reduction="sum")
    n_correct = (target_logits.detach().argmax(dim=-1) == kept).sum()
    return TokenLossSums(loss_sum=loss_sum, n_tokens=int(kept.numel()), n_correct=n_correct)


# Logits of the LM head in chunks of about this many elements (128 MiB in float32), so that a step never
# holds the [N, V] logits of all its targets: for SmolLM2 (V = 49,152) with 4,096 targets a step that
# is 800 MiB of logits plus as much again for their gradient.
CHUNK_ELEMENTS = 2**25
# On a GPU, 8x larger chunks (1 GiB of float32 logits): each chunk re-reads and re-writes the float32
# weight gradient [V, H], so small chunks make the head memory-bound. On a GPU, full SFT of a 0.5B
# model (V = 151,936) ran ~1.14x faster with these chunks than with CHUNK_ELEMENTS, for a few GiB more at
# peak (git log -p docs/benchmarks.md).
CUDA_CHUNK_ELEMENTS = 2**28


class _LinearTokenNLL(torch.autograd.Function):
    """Per-row cross-entropy of ``hidden @ weight.T`` against ``targets`` ([N] NLLs, and [N] whether each
    target is the argmax), chunk by chunk over the rows.

    Forward keeps each chunk's log-sum-exp (4 bytes a row) and drops its logits; backward recomputes a
    chunk's logits from ``hidden`` and ``weight`` and turns them into the gradient at once:
    d nll_i / d logits_i = softmax_i - onehot(target_i), scaled by the upstream gradient of nll_i.

    With a frozen head (LoRA) and ``hidden`` needing a gradient, forward takes that gradient while it holds
    the chunk's softmax instead: row i's gradient is g_i * (softmax_i - onehot_i) @ weight, so forward keeps
    the unscaled [N, H] product and backward only scales its rows by the upstream g_i. Two matrix
    products per chunk instead of three (the recompute was ~5% of a SmolLM2 LoRA step on the CPU).

    The three matrix products per chunk (logits, and the hidden and weight gradients) run in the dtype an
    enclosing autocast gives ``hidden @ weight.T`` (bf16 on a GPU with mixed precision, as the whole-model
    path's ``lm_head`` would), else in float32; log-sum-exp, softmax and the weight gradient's sum stay in
    float32. On an H200 the head in float32 took a quarter of an SFT step of SmolLM2's shapes.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_rows: int,
        gradient_in_forward: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        nll = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        lse = torch.empty_like(nll)
        compute = product_dtype(hidden.device.type, torch.float32)
        unscaled = torch.empty_like(hidden) if gradient_in_forward else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute)
            buffers = _ChunkBuffers(min(chunk_rows, hidden.shape[0]), weight.shape[0], compute, hidden.device)
            for start in range(0, hidden.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                logits = buffers.logits(hidden[rows].to(compute), w)
                target_logits = logits.gather(1, targets[rows, None]).squeeze(1)
                best, best_index = logits.max(dim=-1)  # the index of the first maximum, as argmax
                # log-sum-exp in place: a new [rows, V] tensor per operation cost more in page faults
                # than the arithmetic (SmolLM2 on the CPU: `exp` ~11x slower than `exp_`)
                exp_sum = logits.sub_(best[:, None]).exp_().sum(dim=-1)
                lse[rows] = best + exp_sum.log()
                nll[rows] = lse[rows] - target_logits
                correct[rows] = best_index == targets[rows]
                if unscaled is not None:  # logits now holds exp(logits - best): softmax, minus onehot
                    softmax = logits.div_(exp_sum[:, None])
                    softmax[torch.arange(softmax.shape[0], device=softmax.device), targets[rows]] -= 1.0
                    unscaled[rows] = (buffers.in_compute(softmax) @ w).to(hidden.dtype)
        if unscaled is not None:
            ctx.save_for_backward(unscaled)
        else:
            ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.gradient_in_forward = gradient_in_forward  # type: ignore[attr-defined]
        ctx.chunk_rows = chunk_rows  # type: ignore[attr-defined]
        ctx.compute = compute  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(correct)
        return nll, correct

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_nll: torch.Tensor, _grad_correct: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        if ctx.gradient_in_forward:  # type: ignore[attr-defined]
            (unscaled,) = ctx.saved_tensors  # type: ignore[attr-defined]
            return unscaled * grad_nll[:, None].to(unscaled.dtype), None, None, None, None
        needs_hidden, needs_weight = ctx.needs_input_grad[:2]  # type: ignore[attr-defined]
        hidden, weight, targets, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if needs_weight else None
        chunk_rows: int = ctx.chunk_rows  # type: ignore[attr-defined]
        compute: torch.dtype = ctx.compute  # type: ignore[attr-defined]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute)
            buffers = _ChunkBuffers(min(chunk_rows, hidden.shape[0]), weight.shape[0], compute, hidden.device)
            weight_product = (
                torch.empty_like(w) if grad_weight is not None and compute != torch.float32 else None
            )
            for start in range(0, hidden.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                h = hidden[rows].to(compute)
                grad_logits = buffers.logits(h, w).sub_(lse[rows, None]).exp_()  # softmax, in place
                grad_logits[torch.arange(h.shape[0], device=h.device), targets[rows]] -= 1.0
                grad_logits *= grad_nll[rows, None]
                grad_in_compute = buffers.in_compute(grad_logits)
                if grad_hidden is not None:
                    grad_hidden[rows] = (grad_in_compute @ w).to(hidden.dtype)
                if grad_weight is None:
                    continue
                if weight_product is None:  # float32 products: accumulate in place
                    grad_weight.addmm_(grad_in_compute.T, h)
                else:
                    grad_weight += torch.mm(grad_in_compute.T, h, out=weight_product)
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


class _ChunkBuffers:
    """The two [rows, V] tensors of a chunk (its logits in float32, and the same in the products' dtype),
    allocated once per forward or backward and reused by every chunk. With new ones per chunk, the next
    chunk's were allocated while the last chunk's were still held (a name is rebound only after its new
    value is computed), so a step held two chunks' logits at once and took the second from fresh memory:
    SmolLM2 on the CPU peaked 0.1-0.17 GiB higher with LoRA, 0.07-0.13 GiB in full SFT, at the same speed
    (git log -p docs/benchmarks.md)."""

    def __init__(self, rows: int, vocab: int, compute: torch.dtype, device: torch.device) -> None:
        self._float = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        self._compute = (
            None if compute == torch.float32 else torch.empty(rows, vocab, dtype=compute, device=device)
        )

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``hidden @ weight.T`` in the products' dtype, as float32 in the buffer (valid until the next
        call)."""
        logits = self._float[: hidden.shape[0]]
        if self._compute is None:
            return torch.mm(hidden, weight.T, out=logits)
        return logits.copy_(torch.mm(hidden, weight.T, out=self._compute[: hidden.shape[0]]))

    def in_compute(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` [rows, V] (float32) in the products' dtype."""
        if self._compute is None:
            return values
        return self._compute[: values.shape[0]].copy_(values)


def linear_token_nll(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] NLL, [N] argmax-is-target) of ``hidden @ weight.T`` against ``targets``, for the hidden states
    ``hidden`` [N, H] of target positions and an LM head without bias ``weight`` [V, H], without
    materialising the [N, V] logits: at most ``chunk_rows`` rows of them at a time (default:
    ``CHUNK_ELEMENTS`` // V, ``CUDA_CHUNK_ELEMENTS`` // V on a GPU). ``targets`` [N] holds no
    ``IGNORE_INDEX``."""
    elements = CUDA_CHUNK_ELEMENTS if hidden.device.type == "cuda" else CHUNK_ELEMENTS
    rows = chunk_rows or max(1, elements // weight.shape[0])
    # a frozen head's (LoRA's) hidden-state gradient is taken in forward, but only where a backward will
    # come: `needs_input_grad` is also set under `no_grad`, so grad mode is read here, at the call
    in_forward = torch.is_grad_enabled() and hidden.requires_grad and not weight.requires_grad
    nll, correct = _LinearTokenNLL.apply(  # type: ignore[no-untyped-call]
        hidden, weight, targets, rows, in_forward
    )
    return nll, correct


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_rows: int | None = None
) -> TokenLossSums:
    """``next_token_cross_entropy(hidden @ weight.T, targets)``, summed from ``linear_token_nll``."""
    nll, correct = linear_token_nll(hidden, weight, targets, chunk_rows=chunk_rows)
    return TokenLossSums(loss_sum=nll.sum(), n_tokens=int(targets.numel()), n_correct=correct.sum())
