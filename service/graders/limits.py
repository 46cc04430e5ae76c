"""The sizes a grader may work on, checked before anything runs (issue 46: a `fuzzy_match` over a
20,000-character sample and a 400,000-character reference took 60 s of the API's CPU; 5,000 copies of
`{{item.r}}` over a 100 KB `item.r` took the API from 117 MB to 584 MB).
Every `{{sample.*}}` variable counts as the sample's length (`sample_chars`).

Each cap is a setting (service/config.py, `grader_*`); a grader over one is refused with a 400 naming
the field, e.g. `grader.graders.close.reference`. A template's expanded length is computed from the
lengths of what it reads, so an expansion over the cap is never built: by the API for /run's item, and
by the worker for each row an RL job grades (worker/graders.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

# the one definition of a template variable and its path (render uses them)
from trainers.rewards.graders import _TEMPLATE, lookup

TEMPLATE_FIELDS = ("input", "reference")


def _leaves(spec: Mapping[str, Any], param: str) -> Iterator[tuple[Mapping[str, Any], str]]:
    """Each grader of `spec` that is not a `multi`, with its param path."""
    if spec.get("type") == "multi":
        for name, sub in (spec.get("graders") or {}).items():
            if isinstance(sub, Mapping):
                yield from _leaves(sub, f"{param}.graders.{name}")
    else:
        yield spec, param


def spec_problem(
    spec: Mapping[str, Any], *, param: str, max_text_chars: int, max_sub_graders: int
) -> tuple[str, str] | None:
    """(param, message) of the first cap the spec itself breaks, else None."""
    graders = spec.get("graders")
    if spec.get("type") == "multi" and isinstance(graders, Mapping) and len(graders) > max_sub_graders:
        return (
            f"{param}.graders",
            f"a multi grader has {len(graders)} graders; at most {max_sub_graders} are allowed",
        )
    for leaf, where in _leaves(spec, param):
        for key in TEMPLATE_FIELDS:
            value = leaf.get(key)
            if isinstance(value, str) and len(value) > max_text_chars:
                return f"{where}.{key}", f"{len(value)} characters; at most {max_text_chars} are allowed"
    return None


def expanded_chars(template: str, sample_chars: int, item: Mapping[str, Any]) -> int:
    """The length `trainers.rewards.graders.render` would give `template`, without building it (a variable the
    item lacks counts 0: render reports it).

    >>> expanded_chars("{{item.r}}-{{item.r}}", 5, {"r": "abc"})
    7
    >>> expanded_chars("{{sample.output_text}} {{item.n}}", 5, {"n": [1, 2]})
    12
    >>> expanded_chars("{{item.n[1]}}", 5, {"n": ["a", "bcd"]})
    3
    """
    total = len(template)
    sizes: dict[str, int] = {}  # a path read many times is measured once (json.dumps of a big value)
    for match in _TEMPLATE.finditer(template):
        total -= len(match.group(0))
        if match.group(1) == "sample":
            total += sample_chars
            continue
        path = match.group(2)
        if path not in sizes:
            value = lookup(item, path)[1]
            sizes[path] = (
                0 if value is None else len(value) if isinstance(value, str) else len(json.dumps(value))
            )
        total += sizes[path]
    return total


def expansion_problem(
    spec: Mapping[str, Any],
    *,
    param: str,
    sample_chars: int,
    item: Mapping[str, Any],
    max_text_chars: int,
    subject: str = "this item",
) -> tuple[str, str] | None:
    """(param, message) of the first template of `spec` that would expand past `max_text_chars` for
    this sample and item (`subject` in the message), else None."""
    for leaf, where in _leaves(spec, param):
        for key in TEMPLATE_FIELDS:
            value = leaf.get(key)
            if not isinstance(value, str):
                continue
            size = expanded_chars(value, sample_chars, item)
            if size > max_text_chars:
                return (
                    f"{where}.{key}",
                    f"expands to {size} characters for {subject}; at most {max_text_chars} are allowed",
                )
    return None


def item_bytes(item: Any) -> int:
    return len(json.dumps(item, separators=(",", ":")).encode())
