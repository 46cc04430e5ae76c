"""Model FLOPs utilisation (MFU) of an SFT run on a GPU: the FLOP formula, stated once.

One training pass (forward + backward) over an example of ``t`` real tokens, ``k`` of them loss targets:

    6 * N_body * t        every matmul weight of the decoder: 2 FLOPs per weight and token forward, 4 backward
  + 6 * V * d * k         the LM head (V x d), at the target positions only: what the loss needs
  + 12 * L * d * t**2     attention scores and weighted sums over the example (PaLM's convention: no causal
                          discount, no padding, one example's own length when rows are packed)

``N_body`` counts the decoder's linear weights (attention and MLP projections of every layer), not the
embedding table, the norms or the head. The count is the same for ours and TRL's: work neither side can
skip. TRL also runs the head on prompt and padding positions; that is not counted as useful work. MFU is
those FLOPs per second over the GPU's dense bf16 peak (the datasheet's, and the matmul rate measured in the
same run).

LoRA (``trained_weights=False``) skips the frozen weights' gradients: 2 FLOPs per weight and token
forward and 2 backward (the input's gradient), so the first two terms take 4 instead of 6; attention's
term is unchanged (it has no weights), and the adapters' own products (rank r, r << d) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

H200_BF16_DENSE_PEAK = 989.4e12  # NVIDIA H100/H200 SXM datasheet, dense bf16 (no sparsity)


@dataclass(frozen=True)
class RowShape:
    """The lengths that decide a batch's FLOPs: real tokens and loss targets of each example."""

    tokens: int
    targets: int


def decoder_matmul_weights(config: Any) -> int:
    """Weights in the decoder's linear layers of a Llama-shaped config (q, k, v, o, gate, up, down)."""
    d, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    q_and_o = 2 * d * config.num_attention_heads * head_dim
    k_and_v = 2 * d * config.num_key_value_heads * head_dim
    mlp = 3 * d * inner
    return int(layers * (q_and_o + k_and_v + mlp))


def training_flops(config: Any, rows: list[RowShape], *, trained_weights: bool = True) -> float:
    """FLOPs of one forward + backward pass over ``rows`` (the module docstring's formula; LoRA's when
    ``trained_weights`` is False)."""
    d, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    body = decoder_matmul_weights(config)
    per_weight = 6 if trained_weights else 4
    total = 0.0
    for row in rows:
        total += per_weight * (body * row.tokens + vocab * d * row.targets) + 12 * layers * d * row.tokens**2
    return total


def flops_per_real_token(config: Any, rows: list[RowShape], *, trained_weights: bool = True) -> float:
    """Mean training FLOPs per real token over ``rows``: multiply by a measured tokens/s for FLOP/s."""
    flops = training_flops(config, rows, trained_weights=trained_weights)
    return flops / max(1, sum(row.tokens for row in rows))


def measured_bf16_matmul_rate(size: int = 8192, repeats: int = 10) -> float:
    """FLOP/s of a size^3 bf16 matrix product on this GPU (random inputs, warmed up, mean of ``repeats``)."""
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / repeats
    return 2 * size**3 / seconds
