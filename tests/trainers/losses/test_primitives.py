"""The Tinker built-in losses against their formulas, on hand-made per-token tensors: each value and each
token's gradient against a reference written here from the loss's definition (plain floats, token by
token), so a wrong sign, a missing stop-gradient or a clip on the wrong side fails."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.formats import PRIMITIVE_LOSS_CONFIG, PRIMITIVE_LOSS_INPUTS
from trainers.losses.primitives import (
    LOSSES,
    RECORDED_LOGPROBS,
    RECORDED_MASK,
    cispo,
    cross_entropy,
    dro,
    gspo,
    importance_sampling,
    ppo,
    stable_reinforce,
)


def test_each_declared_loss_is_implemented() -> None:
    assert set(LOSSES) == set(PRIMITIVE_LOSS_INPUTS) == set(PRIMITIVE_LOSS_CONFIG)


def test_cross_entropy_is_the_weighted_sum_of_negative_logprobs() -> None:
    logprobs = torch.tensor([-1.0, -2.0, -0.5])
    loss = cross_entropy(logprobs, {"weights": torch.tensor([1.0, 0.5, 0.0])}, {})
    assert float(loss) == pytest.approx(1.0 + 1.0)  # a sum, not a mean


def test_importance_sampling_weights_advantages_by_the_ratio() -> None:
    logprobs = torch.tensor([-1.0, -2.0])
    sampler = torch.tensor([-1.5, -2.0])
    advantages = torch.tensor([2.0, -1.0])
    loss = importance_sampling(logprobs, {"logprobs": sampler, "advantages": advantages}, {})
    assert float(loss) == pytest.approx(-(math.exp(0.5) * 2.0 + 1.0 * -1.0))


def test_ppo_clips_the_ratio_in_the_direction_of_the_advantage() -> None:
    sampler = torch.tensor([0.0, 0.0, 0.0, 0.0])
    logprobs = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5]))  # ratios, since the sampler's are log 1
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    loss = ppo(logprobs, {"logprobs": sampler, "advantages": advantages}, config)
    # min(ρA, clip(ρ)A) per token: 1.2, 0.5, -1.5, -0.8
    assert float(loss) == pytest.approx(-(1.2 + 0.5 - 1.5 - 0.8))
    # the defaults are Tinker's (0.8, 1.2)
    assert float(ppo(logprobs, {"logprobs": sampler, "advantages": advantages}, {})) == pytest.approx(
        float(loss)
    )


def test_ppo_passes_no_gradient_through_a_clipped_token() -> None:
    logprobs = torch.log(torch.tensor([1.5, 1.1])).requires_grad_(True)
    loss = ppo(logprobs, {"logprobs": torch.zeros(2), "advantages": torch.ones(2)}, {})
    loss.backward()  # type: ignore[no-untyped-call]
    assert logprobs.grad is not None
    assert logprobs.grad[0] == 0 and logprobs.grad[1] != 0


# --- cispo, dro, gspo, stable_reinforce: value and per-token gradient against references ---------------

LOGPROBS = [-1.0, -0.3, -2.2, -0.7, -1.6]
SAMPLER = [-1.4, -0.3, -1.0, -0.75, -3.0]  # ratios ≈ 1.49, 1, 0.30, 1.05, 4.06: inside and outside [0.8, 1.2]
ADVANTAGES = [1.0, -0.5, 2.0, -1.5, 0.7]


def _value_and_grad(
    fn: object, inputs: dict[str, list[float]], config: dict[str, float]
) -> tuple[float, list[float]]:
    logprobs = torch.tensor(LOGPROBS, dtype=torch.float64, requires_grad=True)
    tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in inputs.items()}
    loss = fn(logprobs, tensors, config)  # type: ignore[operator]
    loss.backward()
    assert logprobs.grad is not None
    return float(loss.detach()), logprobs.grad.tolist()


def _clip(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


@pytest.mark.parametrize("config", [{}, {"clip_low_threshold": 0.5, "clip_high_threshold": 1.1}])
def test_cispo_weights_each_token_by_its_detached_clipped_ratio(config: dict[str, float]) -> None:
    low = config.get("clip_low_threshold", 0.8)
    high = config.get("clip_high_threshold", 1.2)
    weights = [_clip(math.exp(p - q), low, high) for p, q in zip(LOGPROBS, SAMPLER, strict=True)]
    value, grad = _value_and_grad(cispo, {"logprobs": SAMPLER, "advantages": ADVANTAGES}, config)
    assert value == pytest.approx(
        -sum(w * a * p for w, a, p in zip(weights, ADVANTAGES, LOGPROBS, strict=True))
    )
    # the ratio is a constant: d/dlog p_t = -clip(ρ_t) A_t, clipped tokens included (unlike PPO)
    assert grad == pytest.approx([-w * a for w, a in zip(weights, ADVANTAGES, strict=True)])


@pytest.mark.parametrize("beta", [None, 0.3])
def test_dro_is_the_advantage_weighted_logprob_minus_a_quadratic_penalty(beta: float | None) -> None:
    b = 0.05 if beta is None else beta
    config = {} if beta is None else {"beta": beta}
    value, grad = _value_and_grad(dro, {"logprobs": SAMPLER, "advantages": ADVANTAGES}, config)
    terms = zip(LOGPROBS, SAMPLER, ADVANTAGES, strict=True)
    assert value == pytest.approx(-sum(p * a - 0.5 * b * (p - q) ** 2 for p, q, a in terms))
    terms = zip(LOGPROBS, SAMPLER, ADVANTAGES, strict=True)
    assert grad == pytest.approx([-(a - b * (p - q)) for p, q, a in terms])


@pytest.mark.parametrize(
    ("mask", "config"),
    [
        ([1, 1, 1, 1, 1], {}),  # s = exp(mean log-ratio) ≈ 1.07: inside the range
        ([1, 0, 0, 0, 0], {}),  # s ≈ 1.49: clipped at 1.2 for the positive advantages
        ([0, 0, 1, 0, 0], {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}),  # s ≈ 0.30: clipped low
    ],
)
def test_gspo_gives_every_token_the_sequence_ratio_clipped_once(
    mask: list[int], config: dict[str, float]
) -> None:
    low = config.get("clip_low_threshold", 0.8)
    high = config.get("clip_high_threshold", 1.2)
    marked = [p - q for p, q, m in zip(LOGPROBS, SAMPLER, mask, strict=True) if m]
    s = math.exp(sum(marked) / len(marked))
    inputs = {"logprobs": SAMPLER, "advantages": ADVANTAGES, "sequence_ratio_mask": [float(m) for m in mask]}
    value, grad = _value_and_grad(gspo, inputs, config)
    assert value == pytest.approx(-sum(min(s * a, _clip(s, low, high) * a) for a in ADVANTAGES))
    # d s_t / d log p_t = s (its own log-probability's gradient); none where the clipped branch is the min
    expected = []
    for a in ADVANTAGES:
        unclipped_is_min = s * a <= _clip(s, low, high) * a or low <= s <= high
        expected.append(-s * a if unclipped_is_min else 0.0)
    assert grad == pytest.approx(expected)


@pytest.mark.parametrize("config", [{}, {"truncation": 1.1}])
def test_stable_reinforce_weights_by_the_recorded_ratio_truncated_on_sampled_tokens(
    config: dict[str, float],
) -> None:
    cap = config.get("truncation", 2.0)
    recorded = SAMPLER
    mask = [0.0, 1.0, 1.0, 1.0, 1.0]  # the first target is a prompt token: no recorded sampling
    inputs = {"advantages": ADVANTAGES, RECORDED_LOGPROBS: recorded, RECORDED_MASK: mask}
    value, grad = _value_and_grad(stable_reinforce, inputs, config)
    weights = [m * min(math.exp(p - r), cap) for p, r, m in zip(LOGPROBS, recorded, mask, strict=True)]
    assert value == pytest.approx(
        -sum(w * a * p for w, a, p in zip(weights, ADVANTAGES, LOGPROBS, strict=True))
    )
    # REINFORCE's gradient A_t ∇log p_t times a constant weight: truncated tokens keep their gradient
    assert grad == pytest.approx([-w * a for w, a in zip(weights, ADVANTAGES, strict=True)])
    # the client's own `logprobs` input plays no part: only the recorded ones do
    with_client_logprobs = {**inputs, "logprobs": [0.0] * len(LOGPROBS)}
    assert _value_and_grad(stable_reinforce, with_client_logprobs, config)[0] == pytest.approx(value)
