"""The reward functions of an RL run as one set (weights, metric names), and one step's scores."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainers.core.errors import DataError
from trainers.rewards.graders import RewardFunc, reward_name


@dataclass(frozen=True)
class RewardScores:
    """One step's scores: ``per_func`` [N, F] (NaN for ``None``), ``total`` [N] (NaN: nobody scored)."""

    per_func: torch.Tensor
    total: torch.Tensor
    names: tuple[str, ...]

    @property
    def scored(self) -> torch.Tensor:
        """[N] bool: at least one reward function scored the completion."""
        return ~torch.isnan(self.total)

    def metrics(self) -> dict[str, float]:
        """``rewards/{name}/mean`` over the completions it scored (NaN if none), and
        ``rewards/{name}/unscored``, the number of completions it returned ``None`` for."""
        out: dict[str, float] = {}
        for i, name in enumerate(self.names):
            column = self.per_func[:, i]
            out[f"rewards/{name}/mean"] = float(torch.nanmean(column))
            out[f"rewards/{name}/unscored"] = float(torch.isnan(column).sum())
        return out


@dataclass(frozen=True)
class RewardSet:
    """The reward functions of an RL run, with their weights and metric names.

    >>> rewards = RewardSet.of([lambda p, c: [len(x) for x in c], lambda p, c: [None, 1.0]], weights=[1, 2])
    >>> s = rewards.score(["q", "q"], ["ab", "abc"], {})
    >>> s.total.tolist(), rewards.names, s.metrics()["rewards/reward_1/unscored"]
    ([2.0, 5.0], ('reward_0', 'reward_1'), 1.0)
    """

    funcs: tuple[RewardFunc, ...]
    weights: tuple[float, ...]
    names: tuple[str, ...]

    @classmethod
    def of(
        cls,
        funcs: Sequence[RewardFunc | Callable[..., Sequence[float | None]]],
        *,
        weights: Sequence[float] | None = None,
        names: Sequence[str] | None = None,
    ) -> RewardSet:
        """Weights default to 1; names to a grader's ``name`` or a function's ``__name__``."""
        if not funcs:
            raise DataError("an RL method needs at least one reward function", param="grader")
        weights = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
        names = [reward_name(f, i) for i, f in enumerate(funcs)] if names is None else list(names)
        if len(weights) != len(funcs) or len(names) != len(funcs):
            raise ValueError("reward weights and names need one entry per reward function")
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be distinct, got {names}")
        return cls(tuple(funcs), tuple(weights), tuple(names))

    def score(
        self, prompts: Sequence[str], completions: Sequence[str], columns: Mapping[str, list[Any]]
    ) -> RewardScores:
        """Call every function once on the whole batch (one entry per completion in every list)."""
        n = len(completions)
        per_func = []
        for func, name in zip(self.funcs, self.names, strict=True):
            scores = func(list(prompts), list(completions), **columns)
            if len(scores) != n:
                raise ValueError(f"reward {name!r} returned {len(scores)} scores for {n} completions")
            per_func.append([math.nan if s is None else float(s) for s in scores])
        matrix = torch.tensor(per_func, dtype=torch.float32).T.reshape(n, len(self.funcs))
        total = (matrix * torch.tensor(self.weights, dtype=torch.float32)).nansum(dim=1)
        total[torch.isnan(matrix).all(dim=1)] = math.nan
        return RewardScores(matrix, total, self.names)
