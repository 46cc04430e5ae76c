""" "Did you mean ...?": the names a mistyped one may have meant, for the refusals of an unknown model,
method or hyperparameter (service/base_models/catalog.py, service/errors.py)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(name: str, candidates: Iterable[str]) -> list[str]:
    """The candidates `name` may have meant (a typo, another case), closest first.

    >>> closest("tunehouse/tiny-lama", ["tunehouse/tiny-llama", "Qwen/Qwen3-8B"])
    ['tunehouse/tiny-llama']
    >>> closest("n_epoch", ["n_epochs", "batch_size"]), closest("xyz", ["n_epochs"])
    (['n_epochs'], [])
    """
    lowered = {c.lower(): c for c in candidates}
    found = difflib.get_close_matches(name.lower(), list(lowered), n=3, cutoff=0.6)
    return [lowered[f] for f in found]


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """ " (did you mean 'x'?)" for the closest candidate, or "".

    >>> did_you_mean("grpoo", ["grpo", "ppo"])
    " (did you mean 'grpo'?)"
    """
    near = closest(name, candidates)
    return f" (did you mean '{near[0]}'?)" if near else ""
