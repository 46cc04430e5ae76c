"""The built-in losses of the training-primitives API (Tinker's `cross_entropy`, `importance_sampling`,
`ppo`). Pure functions on per-token tensors of one datum, each returning a *sum* (Tinker's losses are
sums over tokens, not means: the client decides the normalisation through `weights` or `advantages`).

Shapes: every argument is [T], one entry per input position; `logprobs[t]` is the trainable policy's
log-probability of `target_tokens[t]` given the input up to position t.

- cross_entropy:        L = -Σ_t w_t · logp_t
- importance_sampling:  L = -Σ_t exp(logp_t - q_t) · A_t              (q: the sampler's log-probs)
- ppo:                  L = -Σ_t min(ρ_t A_t, clip(ρ_t, lo, hi) A_t),  ρ_t = exp(logp_t - q_t)
  (Schulman et al. 2017, eq. 7; `clip_low_threshold` and `clip_high_threshold` are lo and hi)

>>> import torch
>>> float(cross_entropy(torch.tensor([-1.0, -2.0]), {"weights": torch.tensor([1.0, 0.0])}, {}))
1.0
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from trainers.formats import PRIMITIVE_LOSS_INPUTS

LossInputs = Mapping[str, torch.Tensor]
LossConfig = Mapping[str, float]
PPO_CLIP_LOW, PPO_CLIP_HIGH = 0.8, 1.2  # Tinker's defaults for ρ's clip range


def cross_entropy(logprobs: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    return -(inputs["weights"].to(logprobs.dtype) * logprobs).sum()


def importance_sampling(logprobs: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    ratio = torch.exp(logprobs - inputs["logprobs"].to(logprobs.dtype))
    return -(ratio * inputs["advantages"].to(logprobs.dtype)).sum()


def ppo(logprobs: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    ratio = torch.exp(logprobs - inputs["logprobs"].to(logprobs.dtype))
    advantages = inputs["advantages"].to(logprobs.dtype)
    low = config.get("clip_low_threshold", PPO_CLIP_LOW)
    high = config.get("clip_high_threshold", PPO_CLIP_HIGH)
    clipped = torch.clamp(ratio, low, high)
    return -torch.min(ratio * advantages, clipped * advantages).sum()


LossFn = Callable[[torch.Tensor, LossInputs, LossConfig], torch.Tensor]
_FUNCTIONS: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
}
# each loss and the `loss_fn_inputs` it reads besides `target_tokens` (declared in trainers/formats.py)
LOSSES: dict[str, tuple[LossFn, tuple[str, ...]]] = {
    name: (_FUNCTIONS[name], inputs) for name, inputs in PRIMITIVE_LOSS_INPUTS.items()
}
