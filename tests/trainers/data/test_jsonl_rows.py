"""trainers.data.jsonl_rows: a JSONL file's rows, parsed one at a time when read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainers.core.errors import DataError
from trainers.data.jsonl_rows import JsonlRows


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(text.encode("utf-8"))
    return path


def test_rows_are_the_non_blank_lines(tmp_path: Path) -> None:
    rows = [{"text": "é ünïcode"}, {"prompt": "p", "completion": "c"}, {"text": "last, no newline"}]
    lines = [
        json.dumps(rows[0], ensure_ascii=False),
        "",
        "  ",
        json.dumps(rows[1]) + "\r",
        json.dumps(rows[2]),
    ]
    read = JsonlRows(_write(tmp_path, "\n".join(lines)), param="training_file")
    assert len(read) == 3
    assert list(read) == rows
    assert read[-1] == rows[2] and read[0] == rows[0]  # any order, any number of times
    assert read[-3] == rows[0]
    assert read[1:] == rows[1:] and read[::-2] == rows[::-2]


def test_out_of_range(tmp_path: Path) -> None:
    read = JsonlRows(_write(tmp_path, '{"a": 1}\n'), param="training_file")
    for bad in (1, -2):
        with pytest.raises(IndexError, match=f"row {bad} of 1"):
            read[bad]
    assert len(JsonlRows(_write(tmp_path, "\n\n"), param="training_file")) == 0


def test_a_line_that_is_not_json_names_its_row_and_file(tmp_path: Path) -> None:
    read = JsonlRows(_write(tmp_path, '{"a": 1}\n\n{"a": \n'), param="validation_file")
    assert read[0] == {"a": 1}
    with pytest.raises(DataError) as caught:
        read[1]
    assert caught.value.param == "validation_file"
    assert caught.value.message.startswith("line 2: not valid JSON (")
