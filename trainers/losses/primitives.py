"""The built-in losses of the training-primitives API (Tinker's `forward_backward` losses). Pure functions
on per-token tensors of one datum, each returning a *sum* (Tinker's losses are sums over tokens, not
means: the client decides the normalisation through `weights` or `advantages`).

Shapes: every argument is [T], one entry per input position; `logprobs[t]` (log p_t below) is the
trainable policy's log-probability of `target_tokens[t]` given the input up to position t; q_t is the
sampler's (`loss_fn_inputs["logprobs"]`), A_t the advantage, ρ_t = exp(log p_t - q_t), sg[·] a stop-gradient.

- cross_entropy:        L = -Σ_t w_t · log p_t
- importance_sampling:  L = -Σ_t ρ_t · A_t
- ppo:                  L = -Σ_t min(ρ_t A_t, clip(ρ_t, lo, hi) A_t)       (Schulman et al. 2017, eq. 7)
- cispo:                L = -Σ_t sg[clip(ρ_t, lo, hi)] · A_t · log p_t     (MiniMax-M1, Chen et al. 2025)
- dro:                  L = -Σ_t (log p_t · A_t - β/2 · (log p_t - q_t)²) (Richemond et al. 2024)
- gspo (GSPO-token):    s = exp(mean_{t∈M} (log p_t - q_t)), s_t = sg[s] · p_t / sg[p_t],
                        L = -Σ_t min(s_t A_t, clip(s_t, lo, hi) A_t)       (Zheng et al. 2025, eq. 7-8;
                        M: the tokens `sequence_ratio_mask` marks)
- stable_reinforce:     L = -Σ_t m_t · sg[min(ρ̂_t, C)] · A_t · log p_t,  ρ̂_t = exp(log p_t - r_t)
  REINFORCE with truncated importance weights (TIS, Yao et al. 2025) against r_t, the log-probability the
  *server's sampler recorded* for that token when it sampled it (m_t = 1 where the datum's provenance
  names a sampled token), not one the client sends: the weight corrects for a sampler that ran stale
  weights or other numerics, and its cap C (`truncation`) bounds the variance. Tinker documents this
  loss's contract (record at sampling, name the sequences in the datum) but not its formula; this is ours.

These are Tinker's documented formulas (tinker-docs: losses/ppo, cispo, dro, gspo), with lo, hi, β
and C from `loss_fn_config` (defaults: trainers/formats.py PRIMITIVE_LOSS_CONFIG).

>>> import torch
>>> float(cross_entropy(torch.tensor([-1.0, -2.0]), {"weights": torch.tensor([1.0, 0.0])}, {}))
1.0
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from trainers.formats import (
    PRIMITIVE_LOSS_CONFIG,
    PRIMITIVE_LOSS_INPUTS,
    PRIMITIVE_LOSS_PROVENANCE,
    RECORDED_LOGPROBS,
    RECORDED_MASK,
)

LossInputs = Mapping[str, torch.Tensor]
LossConfig = Mapping[str, float]


def _config(name: str, config: LossConfig, key: str) -> float:
    return float(config.get(key, PRIMITIVE_LOSS_CONFIG[name][key]))


def _ratio(logprobs: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    return torch.exp(logprobs - inputs["logprobs"].to(logprobs.dtype))


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    return -torch.min(ratio * advantages, torch.clamp(ratio, low, high) * advantages).sum()


def cross_entropy(logprobs: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    return -(inputs["weights"].to(logprobs.dtype) * logprobs).sum()


def importance_sampling(logprobs: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    return -(_ratio(logprobs, inputs) * inputs["advantages"].to(logprobs.dtype)).sum()


def ppo(logprobs: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    low = _config("ppo", config, "clip_low_threshold")
    high = _config("ppo", config, "clip_high_threshold")
    return _clipped_surrogate(_ratio(logprobs, inputs), inputs["advantages"].to(logprobs.dtype), low, high)


def cispo(logprobs: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    low = _config("cispo", config, "clip_low_threshold")
    high = _config("cispo", config, "clip_high_threshold")
    weight = torch.clamp(_ratio(logprobs, inputs), low, high).detach()
    return -(weight * logprobs * inputs["advantages"].to(logprobs.dtype)).sum()


def dro(logprobs: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    beta = _config("dro", config, "beta")
    quadratic = (logprobs - inputs["logprobs"].to(logprobs.dtype)) ** 2
    return -(logprobs * inputs["advantages"].to(logprobs.dtype) - 0.5 * beta * quadratic).sum()


def gspo(logprobs: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    low = _config("gspo", config, "clip_low_threshold")
    high = _config("gspo", config, "clip_high_threshold")
    in_ratio = inputs["sequence_ratio_mask"] != 0
    log_ratio = (logprobs.detach() - inputs["logprobs"].to(logprobs.dtype))[in_ratio].mean()
    # every token carries the sequence ratio's value and its own log-probability's gradient
    ratio = torch.exp(log_ratio + logprobs - logprobs.detach())
    return _clipped_surrogate(ratio, inputs["advantages"].to(logprobs.dtype), low, high)


def stable_reinforce(logprobs: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    cap = _config("stable_reinforce", config, "truncation")
    mask = inputs[RECORDED_MASK].to(logprobs.dtype)
    recorded = inputs[RECORDED_LOGPROBS].to(logprobs.dtype)
    weight = torch.clamp(torch.exp(logprobs.detach() - recorded), max=cap) * mask
    return -(weight * inputs["advantages"].to(logprobs.dtype) * logprobs).sum()


LossFn = Callable[[torch.Tensor, LossInputs, LossConfig], torch.Tensor]
_FUNCTIONS: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
}
# each loss and the inputs it reads besides `target_tokens` (declared in trainers/formats.py): the
# client's `loss_fn_inputs`, and for a provenance loss what the sampler recorded
LOSSES: dict[str, tuple[LossFn, tuple[str, ...]]] = {
    name: (
        _FUNCTIONS[name],
        inputs + ((RECORDED_LOGPROBS, RECORDED_MASK) if name in PRIMITIVE_LOSS_PROVENANCE else ()),
    )
    for name, inputs in PRIMITIVE_LOSS_INPUTS.items()
}
