"""docs/vision.md matches behaviour: every example block is a file the upload validator accepts (its
images decoded and checked) and that its method's reader trains on a tiny Gemma 3 base with its real
chat template, each image through the processor."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from service.files.validation import method_formats, validate_chunks
from trainers.data.preference import tokenize_preference_rows
from trainers.data.sft import tokenize_sft_rows
from trainers.data.vision import ImageFiles, VisionData
from trainers.modeling.vision import load_processor

PAGE = (Path(__file__).resolve().parents[3] / "docs" / "vision.md").read_text(encoding="utf-8")
EXAMPLES = [
    (method, [json.loads(line) for line in block.splitlines()])
    for method, block in re.findall(r"<!-- example: (\w+) -->\n```jsonl\n(.*?)\n```", PAGE, re.S)
]
READERS = {"supervised": tokenize_sft_rows, "dpo": tokenize_preference_rows}


def test_the_page_has_an_example_for_each_method_that_takes_images() -> None:
    assert {method for method, _ in EXAMPLES} == set(READERS)


@pytest.mark.parametrize(("method", "rows"), EXAMPLES, ids=[m for m, _ in EXAMPLES])
def test_each_example_is_accepted_and_read_with_its_images(
    method: str, rows: list[dict[str, Any]], vision_models: dict[str, Path]
) -> None:
    stats = validate_chunks(["".join(json.dumps(r) + "\n" for r in rows).encode()])
    assert stats.format in method_formats(method) and stats.images > 0
    processor = load_processor(str(vision_models["gemma3"]))
    vision = VisionData(processor, ImageFiles())
    examples = READERS[method](rows, processor.tokenizer, max_length=4096, vision=vision)
    images = [getattr(e, "vision", {"images": []})["images"] for e in examples]
    assert sum(len(i) for i in images) == stats.images
