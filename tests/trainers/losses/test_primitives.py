"""The Tinker built-in losses against their formulas, on hand-made per-token tensors."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.formats import PRIMITIVE_LOSS_INPUTS
from trainers.losses.primitives import LOSSES, cross_entropy, importance_sampling, ppo


def test_each_declared_loss_is_implemented() -> None:
    assert set(LOSSES) == set(PRIMITIVE_LOSS_INPUTS)


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
