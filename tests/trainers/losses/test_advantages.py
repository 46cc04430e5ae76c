"""Advantages of the online RL methods (trainers/losses/advantages.py): GRPO's and RLOO's equal TRL's own
code,
PPO's per-token rewards, GAE and whitening equal the papers' equations written out, and online DPO's judge
orders each pair by its scores. Pure tensor tests, fast enough for the mutation check."""

from __future__ import annotations

import doctest

import pytest
import torch
from trl.trainer.utils import nanstd as trl_nanstd

import trainers.losses.advantages
from trainers.losses.advantages import (
    gae,
    group_advantages,
    group_reward_metrics,
    judge_pairs,
    masked_whiten,
    nanstd,
    per_token_rewards,
    rloo_advantages,
    sequence_kl,
)


# -- GRPO: against TRL 1.16 ---------------------------------------------------------------------------------
def trl_group_advantages(rewards: torch.Tensor, num_generations: int, scale: str) -> torch.Tensor:
    """trl/trainer/grpo_trainer.py (1.16) lines 2765-2787 and 2810, the sum_then_normalize path after the
    weighted sum; that code is inline in `_generate_and_score_completions`, so it is copied here verbatim
    except for `self.` and the device."""
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale in ["group", "none"]:
        std_rewards = trl_nanstd(rewards.view(-1, num_generations), dim=1)
        std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    else:
        std_rewards = trl_nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_trl(scale: str) -> None:
    torch.manual_seed(0)
    rewards = torch.randn(24)
    rewards[4:8] = 1.0  # a group with zero std
    rewards[9] = float("nan")  # unscored completion
    ours = group_advantages(rewards, 4, scale)
    assert torch.allclose(ours, trl_group_advantages(rewards, 4, scale), atol=1e-6)
    assert torch.all(ours[4:8] == 0) and ours[9] == 0


# -- PPO: the papers' equations, written out ----------------------------------------------------------------
LENGTHS = [5, 3, 1, 4]


def completion_mask() -> torch.Tensor:
    return (torch.arange(5) < torch.tensor(LENGTHS).unsqueeze(1)).float()


def test_gae_equals_the_discounted_sum_of_td_errors() -> None:
    torch.manual_seed(0)
    rewards, values = torch.randn(4, 5), torch.randn(4, 5)
    gamma, lam = 0.9, 0.8
    adv, ret = gae(rewards, values, completion_mask(), gamma=gamma, lam=lam)
    for b, n in enumerate(LENGTHS):
        r, v = rewards[b, :n].tolist(), [*values[b, :n].tolist(), 0.0]  # V = 0 after the last token
        delta = [r[t] + gamma * v[t + 1] - v[t] for t in range(n)]
        for t in range(n):
            expected = sum((gamma * lam) ** k * delta[t + k] for k in range(n - t))
            assert adv[b, t].item() == pytest.approx(expected, abs=1e-5)
            assert ret[b, t].item() == pytest.approx(expected + v[t], abs=1e-5)
        assert not adv[b, n:].any() and not ret[b, n:].any()


def test_whitening_uses_masked_mean_and_unbiased_std() -> None:
    torch.manual_seed(1)
    x, mask = torch.randn(4, 5) * 3 + 2, completion_mask()
    out = masked_whiten(x, mask)
    kept = x[mask.bool()].tolist()
    mean = sum(kept) / len(kept)
    std = (sum((k - mean) ** 2 for k in kept) / (len(kept) - 1)) ** 0.5
    expected = torch.where(mask.bool(), (x - mean) / std, torch.zeros_like(x))
    assert torch.allclose(out, expected, atol=1e-5)


def test_per_token_rewards_on_a_hand_built_rollout() -> None:
    # Three completions of 3, 1 and 4 tokens (EOS included), right-padded to 4. The reference's log-probs
    # at padding are -9 so that a penalty leaking past a completion's end would show.
    logps = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-3.0, 0.0, 0.0, 0.0], [-0.1, -0.2, -0.3, -0.4]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, -9.0], [-2.0, -9.0, -9.0, -9.0], [-0.3, -0.1, -0.6, -0.2]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    rewards, kl = per_token_rewards(torch.tensor([2.0, -1.0, 0.5]), logps, ref, mask, kl_coef=0.1)
    # kl_t = logp - ref; r_t = -0.1 kl_t, plus the score on the last real token.
    assert torch.allclose(
        kl, torch.tensor([[0.5, -1.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0], [0.2, -0.1, 0.3, -0.2]]), atol=1e-6
    )
    expected = torch.tensor(
        [[-0.05, 0.1, 2.0, 0.0], [0.1 - 1.0, 0.0, 0.0, 0.0], [-0.02, 0.01, -0.03, 0.02 + 0.5]]
    )
    assert torch.allclose(rewards, expected, atol=1e-6)


# -- RLOO: against TRL 1.16 ---------------------------------------------------------------------------------
def trl_rloo_advantages(
    rewards: torch.Tensor,
    k: int,
    *,
    normalize: bool,
    beta: float = 0.0,
    old: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """trl/trainer/rloo_trainer.py (1.16) lines 1663-1699 (KL penalty, leave-one-out baseline,
    normalisation), after the weighted sum; that code is inline in `_generate_and_score_completions`, so it
    is copied here verbatim except for `self.`, `gather` (one process) and the k = 1 branch."""
    if beta != 0.0:
        assert old is not None and ref is not None and mask is not None
        per_token_kl = old - ref
        kl = (per_token_kl * mask).sum(-1)
        rewards = rewards - beta * kl
    grouped_rewards = rewards.view(-1, k)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)  # (num_prompts, 1)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)  # (num_prompts, 1)
    baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)  # (num_prompts, num_generations)
    baselines = baselines.view(-1)  # Flatten back to match rewards shape
    advantages = rewards - baselines
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (trl_nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_rloo_advantages_equal_trl(normalize: bool, beta: float) -> None:
    torch.manual_seed(0)
    k, n = 4, 24
    rewards = torch.randn(n)
    rewards[4:8] = 1.0  # a group with zero spread
    rewards[9] = float("nan")  # unscored completion
    rewards[13:16] = float("nan")  # a group with a single scored completion
    old, ref = torch.randn(n, 5) - 2, torch.randn(n, 5) - 2
    mask = (torch.arange(5) < torch.randint(1, 6, (n, 1))).long()
    theirs = trl_rloo_advantages(rewards, k, normalize=normalize, beta=beta, old=old, ref=ref, mask=mask)
    kl = sequence_kl(old, ref, mask)
    ours = rloo_advantages(rewards, k, kl=kl, beta=beta, normalize=normalize)
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert ours[9] == 0 and torch.all(ours[12:16] == 0)
    if not normalize and beta == 0.0:
        assert torch.all(ours[4:8] == 0)
        # the leave-one-out baseline, written out: A_i = r_i - mean of the others
        r = rewards[:4]
        assert ours[0] == pytest.approx(float(r[0] - r[1:].mean()), abs=1e-6)
    assert torch.allclose(kl, ((old - ref) * mask).sum(1))


def test_doctests_pass() -> None:
    result = doctest.testmod(trainers.losses.advantages)
    assert result.attempted >= 6 and result.failed == 0


def test_group_advantages_by_hand_and_their_default_scale() -> None:
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])  # two groups of 2: one with a spread, one without
    std = 2**-0.5  # of (1, 0), with Bessel's correction
    assert group_advantages(rewards, 2).tolist() == group_advantages(rewards, 2, "group").tolist()
    assert group_advantages(rewards, 2).tolist() == pytest.approx(
        [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0, 0]
    )
    batch_std = float(torch.tensor([1.0, 0.0, 2.0, 2.0]).std())
    assert group_advantages(rewards, 2, "batch").tolist() == pytest.approx(
        [0.5 / (batch_std + 1e-4), -0.5 / (batch_std + 1e-4), 0, 0]
    )
    # one prompt, two completions: the batch std is the group's
    assert group_advantages(rewards[:2], 2, "batch").tolist() == pytest.approx(
        [0.5 / (std + 1e-4), -0.5 / (std + 1e-4)]
    )
    assert group_advantages(torch.tensor([3.0]), 1, "batch").tolist() == [0.0]  # one reward: no signal
    with pytest.raises(
        ValueError, match=r"scale_rewards must be one of \('group', 'batch', 'none'\), not 'mean'"
    ):
        group_advantages(rewards, 2, "mean")


def test_group_reward_metrics() -> None:
    # groups (1, 0): std 0.7071; (1, 1): std 0; (NaN, 2): one scored completion, no std
    metrics = group_reward_metrics(torch.tensor([1.0, 0.0, 1.0, 1.0, float("nan"), 2.0]), 2)
    assert metrics == pytest.approx({"reward": 1.0, "reward_std": 2**-0.5 / 2, "frac_reward_zero_std": 1 / 3})


def test_nanstd_ignores_nan_and_needs_two_values() -> None:
    x = torch.tensor([[1.0, 0.0, float("nan")], [4.0, float("nan"), float("nan")]])
    assert nanstd(x, dim=1)[0].item() == pytest.approx(2**-0.5)
    assert torch.isnan(nanstd(x, dim=1)[1])
    assert nanstd(x).item() == pytest.approx(float(torch.tensor([1.0, 0.0, 4.0]).std()))
    assert nanstd(x).shape == ()


# -- PPO and online DPO: the edges ---------------------------------------------------------------------------
def test_whitening_keeps_its_epsilon_and_an_empty_mask_gives_zeros() -> None:
    x = torch.tensor([[0.0, 1e-4, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    var = 5e-9  # of (0, 1e-4), unbiased: eps = 1e-8 dominates it
    expected = torch.tensor([[-5e-5, 5e-5, 0.0]]) / (var + 1e-8) ** 0.5
    assert torch.allclose(masked_whiten(x, mask), expected, rtol=1e-4)
    assert masked_whiten(x, torch.zeros(1, 3)).tolist() == [[0.0, 0.0, 0.0]]


def test_the_judge_skips_only_the_pairs_it_cannot_order() -> None:
    pairs = judge_pairs(torch.tensor([1.0, 0.0, float("nan"), 1.0, 0.5, 0.5, 0.0, 2.0]))
    assert pairs.judged.tolist() == [True, False, False, True]
    assert pairs.chosen.tolist()[::3] == [0, 7] and pairs.rejected.tolist()[::3] == [1, 6]


def test_rloo_with_a_kl_penalty_needs_the_kl() -> None:
    with pytest.raises(ValueError, match=r"^beta > 0 needs the completions' KL to the reference$"):
        rloo_advantages(torch.zeros(4), 2, beta=0.1)


def test_whitening_one_value_gives_zero_not_nan() -> None:
    # one masked value: no spread to divide by, and no n - 1 = 0 correction either
    assert masked_whiten(torch.tensor([[3.0, 7.0]]), torch.tensor([[0, 1]])).tolist() == [[0.0, 0.0]]


def test_the_judge_keeps_its_indices_on_the_scores_device() -> None:
    # the meta device stands in for a GPU here: an index built on the CPU could not pick from it
    pairs = judge_pairs(torch.zeros(4, device="meta"))
    assert {t.device.type for t in (pairs.chosen, pairs.rejected, pairs.judged)} == {"meta"}
