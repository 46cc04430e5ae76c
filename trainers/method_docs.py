"""The generated tables of the docs: docs/methods.md's methods table and hyperparameter reference (from
``trainers.registry``) and docs/data-formats.md's chat row fields (from ``trainers.chat.rows.FIELDS``).

    python -m trainers.method_docs      # rewrite the generated blocks of both pages in place (make docs)

A block sits between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``; ``tests/trainers/test_registry.py``
fails when a page differs from what this writes. Standard library only, like the registry.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from trainers.chat.rows import FIELDS
from trainers.registry import COMMON, LOOP_METRICS, METHODS, Hyperparameter

# The JSONL shape of each training-file format a method may declare (the upload validator's formats).
FORMAT_SHAPES: dict[str, str] = {
    "chat": '`{"messages", "tools"}` (OpenAI\'s chat row: [data-formats.md](data-formats.md); loss on '
    'assistant turns, tool calls and reasoning included; `"weight": 0` skips one)',
    "prompt_completion": '`{"prompt", "completion"}` (loss on the completion)',
    "text": '`{"text"}` (every token)',
    "preference": '`{"input": {"messages"}, "preferred_output", "non_preferred_output"}` or '
    '`{"prompt", "chosen", "rejected"}`',
    "prompt_only": '`{"messages"}` ending in a user turn, or `{"prompt"}`, plus fields graders read',
    "unpaired_preference": '`{"prompt", "completion", "label": true\\|false}` (strings or message lists) or '
    '`{"messages", "label"}` (the last, assistant message is the judged completion)',
}


def methods_table() -> str:
    rows = [
        "| `method.type` | data (JSONL, one format per file) | what runs | metrics (besides the loop's) |",
        "| --- | --- | --- | --- |",
    ]
    for m in METHODS.values():
        data = "; ".join(FORMAT_SHAPES[f] for f in m.formats)
        metrics = ", ".join(f"`{name}`" for name in m.metrics)
        what = m.summary + ("; needs a `grader`" if m.grader else "")
        rows.append(f"| `{m.name}` | {data} | {what} | {metrics} |")
    loop = ", ".join(f"`{name}`" for name in LOOP_METRICS)
    rows.append("")
    rows.append(
        f"Every step also reports {loop}; a validation pass reports `valid_loss` and `valid_` + each "
        "loss metric, or for the methods with a `grader` `valid_reward` and `valid_reward/{grader}` "
        "(the grader on the policy's completions of the validation prompts). `{grader}` is the "
        "grader's `name`; `unscored` counts the completions it returned no score for."
    )
    return "\n".join(rows)


def _default(p: Hyperparameter) -> str:
    if p.auto:
        return f"`auto` ({p.auto_value})" if p.auto_value is not None else "`auto` (from the data size)"
    return "`" + json.dumps(p.default) + "`"


def _row(p: Hyperparameter, methods: list[str]) -> str:
    default = _default(p)
    where = "all" if len(methods) == len(METHODS) else ", ".join(f"`{m}`" for m in methods)
    return f"| `{p.name}` | {p.describe()} | {default} | {where} | {p.doc} |"


def hyperparameters_table() -> str:
    rows = ["| name | accepts | default | methods | meaning |", "| --- | --- | --- | --- | --- |"]
    seen: dict[Hyperparameter, list[str]] = {}
    for m in METHODS.values():
        for p in m.hyperparameters:
            seen.setdefault(p, []).append(m.name)
    common = [p for p in seen if p in COMMON]
    rows += [_row(p, seen[p]) for p in common]
    rows += [_row(p, seen[p]) for p in seen if p not in COMMON]
    return "\n".join(rows)


def chat_fields_table() -> str:
    rows = ["| where | field | accepts | meaning |", "| --- | --- | --- | --- |"]
    for f in FIELDS:
        names = " / ".join(f"`{name.strip()}`" for name in f.name.split("/"))
        rows.append(f"| {f.where} | {names} | {f.accepts} | {f.meaning} |")
    return "\n".join(rows)


PAGES: dict[str, dict[str, Callable[[], str]]] = {
    "docs/methods.md": {"methods": methods_table, "hyperparameters": hyperparameters_table},
    "docs/data-formats.md": {"chat-fields": chat_fields_table},
}


def render(page: str, blocks: dict[str, Callable[[], str]]) -> str:
    """``page`` (a page's text) with each of ``blocks`` replaced by its current text."""
    for name, make in blocks.items():
        found = re.search(rf"(<!-- {name}:begin -->\n)(?:.*?\n)?(<!-- {name}:end -->)", page, re.S)
        if found is None:
            raise ValueError(f"the page has no <!-- {name}:begin/end --> block")
        block = found.group(1) + make() + "\n" + found.group(2)
        page = page[: found.start()] + block + page[found.end() :]
    return page


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path()
    for name, blocks in PAGES.items():
        path = root / name
        path.write_text(render(path.read_text(encoding="utf-8"), blocks), encoding="utf-8")
