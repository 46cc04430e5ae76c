"""docs/data-formats.md matches behaviour: every example block is a file the upload validator accepts for
its method and that method's reader trains (on the tiny model's tokenizer with Qwen3's real template);
the examples use every field the page's table declares; and the family table says "refused" exactly
where tests/trainers/data/test_chat_render.py finds the template refusing."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from service.files.validation import method_formats, validate_chunks
from tests.trainers.data.test_chat_render import REFUSED, TEMPLATES
from trainers.chat.rows import FIELDS
from trainers.data.preference import tokenize_preference_rows
from trainers.data.sft import tokenize_sft_rows
from trainers.data.unpaired import tokenize_unpaired_rows
from trainers.families.rollout import tokenize_rl_rows

DOCS = Path(__file__).resolve().parents[3] / "docs"
PAGE = (DOCS / "data-formats.md").read_text(encoding="utf-8")
EXAMPLES = [
    (method, [json.loads(line) for line in block.splitlines()])
    for method, block in re.findall(r"<!-- example: (\w+) -->\n```jsonl\n(.*?)\n```", PAGE, re.S)
]
READERS = {
    "supervised": lambda rows, tok: tokenize_sft_rows(rows, tok, max_length=1024),
    "dpo": lambda rows, tok: tokenize_preference_rows(rows, tok, max_length=1024),
    "kto": lambda rows, tok: tokenize_unpaired_rows(rows, tok, max_length=1024),
    "grpo": lambda rows, tok: tokenize_rl_rows(rows, tok, max_prompt_length=1024),
}


@pytest.fixture(scope="module")
def qwen3(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    made = copy.deepcopy(tokenizer)
    made.chat_template = (TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8")
    return made


def test_the_page_has_an_example_for_every_method_family() -> None:
    assert {method for method, _ in EXAMPLES} == set(READERS) and len(EXAMPLES) >= 10


@pytest.mark.parametrize(("method", "rows"), EXAMPLES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(EXAMPLES)])
def test_each_example_is_accepted_and_read_by_its_method(
    method: str, rows: list[dict[str, Any]], qwen3: PreTrainedTokenizerBase
) -> None:
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    stats = validate_chunks([data])
    assert stats.format in method_formats(method)
    assert len(READERS[method](rows, qwen3)) >= 1


def test_the_examples_use_every_declared_field() -> None:
    keys: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            keys.update(value)
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    # the image parts' examples are on docs/vision.md (tests/trainers/data/test_vision_doc.py reads them)
    vision = (DOCS / "vision.md").read_text(encoding="utf-8")
    for _, rows in EXAMPLES + re.findall(r"<!-- example: (\w+) -->\n```jsonl\n(.*?)\n```", vision, re.S):
        walk([json.loads(line) for line in rows.splitlines()] if isinstance(rows, str) else rows)
    for field in FIELDS:
        assert any(name.strip() in keys for name in field.name.split("/")), field.name


def test_the_family_table_says_refused_where_the_template_refuses() -> None:
    table = [line for line in PAGE.splitlines() if line.startswith("| ") and "(`" in line]
    assert len(table) == len(REFUSED)
    for line in table:
        template = re.search(r"\(`(\w+)`", line)
        assert template is not None and template.group(1) in REFUSED, line
        refused = REFUSED[template.group(1)]
        _, tool_calls, reasoning, _ = (cell.strip() for cell in line.strip("| ").split(" | "))
        assert (tool_calls == "refused") == ("tool calls" in refused), line
        assert (reasoning == "refused") == ("reasoning" in refused), line
