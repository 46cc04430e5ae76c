"""Values no request may carry, checked once for every request before any route sees it.

PostgreSQL cannot store a NUL in a text value nor a lone UTF-16 surrogate in UTF-8, JSON columns
cannot hold NaN or Infinity (Python's json module accepts them, and reads `1e999` as infinity), and
an integer beyond 64 bits overflows every integer column. Left to the database, each of these would be
a 500 after validation had passed. service.middleware checks every JSON body with `unsafe_value`,
service.dependencies every path and query parameter with `text_problem`, and uploaded files are
checked line by line (service.files.validation): each finding is a 400 naming the parameter or line.
Standard library only, so the file validator stays importable anywhere.

    >>> unsafe_value({"method": {"hp": {"n_epochs": float("nan")}}})
    ('method.hp.n_epochs', 'must be a finite number')
    >>> unsafe_value({"metadata": {"k": ["ok", "a\\x00b"]}})
    ('metadata.k[1]', 'must not contain a NUL character')
    >>> unsafe_value({"seed": 10**20})
    ('seed', 'is out of range (integers are limited to 64 bits)')
    >>> unsafe_value({"ok": [1, 2.5, "x", None, True]}) is None
    True
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

MAX_INT = 2**63 - 1
# no request schema nests deeper than ~8 levels; 64 keeps the walk far from Python's recursion limit
MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "must not contain a NUL character"
    if _SURROGATE.search(text):
        return "must not contain a lone UTF-16 surrogate"
    return None


def unsafe_value(value: Any, path: str = "", depth: int = 0) -> tuple[str, str] | None:
    """The first (param, problem) in a parsed JSON value that no column can store, or None."""
    if depth > MAX_DEPTH:
        return path, f"is nested more than {MAX_DEPTH} levels deep"
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, "must be a finite number")
    if isinstance(value, int):
        if -MAX_INT - 1 <= value <= MAX_INT:
            return None
        return path, "is out of range (integers are limited to 64 bits)"
    if isinstance(value, str):
        problem = text_problem(value)
        return (path, problem) if problem else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            name = _child(path, str(key))
            if problem := text_problem(str(key)):
                return name, f"parameter name {problem}"
            if found := unsafe_value(item, name, depth + 1):
                return found
        return None
    if isinstance(value, list):
        for index, item in enumerate(value):
            if found := unsafe_value(item, _child(path, index), depth + 1):
                return found
    return None
