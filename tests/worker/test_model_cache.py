"""The inference worker's LRU model cache (worker/model_cache.py): reuse, eviction order, the budget."""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker.model_cache import LoadedModel, ModelCache, model_bytes


def _loader(loads: list[str], key: str, nbytes: int) -> Callable[[], LoadedModel]:
    def load() -> LoadedModel:
        loads.append(key)
        return LoadedModel(model=None, tokenizer=None, nbytes=nbytes)

    return load


def test_least_recently_used_model_is_dropped_to_fit_the_budget() -> None:
    cache, loads = ModelCache(budget_bytes=100), list[str]()
    a = cache.get("a", _loader(loads, "a", 40))
    cache.get("b", _loader(loads, "b", 40))
    assert cache.get("a", _loader(loads, "a", 40)) is a  # a hit: not loaded again, and now the newest
    cache.get("c", _loader(loads, "c", 40))  # 120 > 100: b (least recently used) goes, a stays
    assert loads == ["a", "b", "c"] and list(cache.entries) == ["a", "c"] and cache.used_bytes == 80
    cache.get("big", _loader(loads, "big", 500))  # larger than the budget: served alone
    assert list(cache.entries) == ["big"]


def test_model_bytes_counts_parameters_and_buffers() -> None:
    model = torch.nn.BatchNorm1d(4)  # 2x4 fp32 parameters + 2x4 fp32 buffers + an int64 counter
    assert model_bytes(model) == 16 * 4 + 8
