"""One rank of the step-wide statistics check, for tests/trainers/core/test_distributed.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.trainers.dist_stats_entry OUT

Each rank holds its share of one batch (``share``: rank 0 has 4 completions, rank 1 has 6, and their
completions have different widths), computes the statistics the online methods take over the whole
step and a step's sampling seed, and writes them to ``{OUT}.rank{R}.pt``; the test compares them with
one process's over the batch.
"""

from __future__ import annotations

import sys

import torch

from trainers.core import distributed as dist
from trainers.families.rollout import rollout_seed
from trainers.losses.advantages import group_advantages, masked_whiten

ROWS = (4, 6)  # completions per rank (2 per prompt): unequal, as at an epoch's end
WIDTHS = (5, 3)  # completion width per rank: each rank pads its own rollout


def share(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rewards [n] (with a NaN: unscored), advantages [n, T] and mask [n, T]."""
    generator = torch.Generator().manual_seed(rank)
    n, width = ROWS[rank], WIDTHS[rank]
    rewards = torch.randn(n, generator=generator)
    rewards[1] = float("nan")
    advantages = torch.randn(n, width, generator=generator)
    lengths = torch.randint(1, width + 1, (n,), generator=generator)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).float()
    return rewards, advantages, mask


def main(out: str) -> None:
    dist.init_from_env(timeout_seconds=60)
    rank = dist.rank()
    rewards, advantages, mask = share(rank)
    (everyone,), mine = dist.gather_rows(rewards)
    result = {
        "gathered": everyone,
        "mine": (mine.start, mine.stop),
        "batch_scaled": group_advantages(everyone, 2, "batch")[mine],
        "whitened": masked_whiten(advantages, mask, across=dist.sum_tensor),
        "summed": dist.sum_tensor(mask.sum()),
    }
    torch.manual_seed(0)  # the loop's RNG, the same on every rank
    result["sampling_seed"] = rollout_seed()
    torch.save(result, f"{out}.rank{rank}.pt")
    dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
