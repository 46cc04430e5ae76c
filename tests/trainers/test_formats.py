"""One detection rule for the training-file formats (``trainers.formats``): every example the upload
validator classifies is read by the trainers' reader of that format, and refused by the readers of the
other formats, so a file the API accepted for a method is one its trainer reads."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from service.files.validation import validate_chunks
from tests.service.test_file_validation import (
    CHAT,
    FEEDBACK,
    FEEDBACK_CHAT,
    FEEDBACK_MESSAGES,
    PC,
    PREF_OPENAI,
    PREF_PAIRS,
    RL_MESSAGES,
    RL_PROMPT,
    TEXT,
)
from trainers.core.errors import DataError
from trainers.data.preference import tokenize_preference_rows
from trainers.data.sft import tokenize_sft_rows
from trainers.data.unpaired import tokenize_unpaired_rows
from trainers.families.rollout import tokenize_rl_rows
from trainers.formats import FileFormat

Reader = Callable[[Sequence[dict[str, Any]], PreTrainedTokenizerBase], object]

READERS: dict[str, Reader] = {
    "sft": lambda rows, tok: tokenize_sft_rows(rows, tok, max_length=256),
    "preference": lambda rows, tok: tokenize_preference_rows(rows, tok, max_length=256),
    "unpaired": lambda rows, tok: tokenize_unpaired_rows(rows, tok, max_length=256),
    "rl": lambda rows, tok: tokenize_rl_rows(rows, tok, max_prompt_length=128),
}
# the reader each format's file goes to (KTO's reader also takes preference pairs, unpaired as TRL does)
READS: dict[FileFormat, set[str]] = {
    FileFormat.CHAT: {"sft"},
    FileFormat.PROMPT_COMPLETION: {"sft"},
    FileFormat.TEXT: {"sft"},
    FileFormat.PREFERENCE: {"preference", "unpaired"},
    FileFormat.UNPAIRED_PREFERENCE: {"unpaired"},
    FileFormat.PROMPT_ONLY: {"rl"},
}
FIXTURES = [CHAT, PC, TEXT, PREF_OPENAI, PREF_PAIRS, RL_MESSAGES, RL_PROMPT, FEEDBACK, FEEDBACK_CHAT]
FIXTURES += [FEEDBACK_MESSAGES]


def test_every_format_has_a_fixture_and_a_reader() -> None:
    detected = {validate_chunks([json.dumps(row).encode() + b"\n"]).format for row in FIXTURES}
    assert detected == {f.value for f in FileFormat} == {f.value for f in READS}


@pytest.mark.parametrize("row", FIXTURES, ids=lambda row: "/".join(row))
@pytest.mark.parametrize("reader", READERS)
def test_the_validators_format_is_the_one_the_trainers_read(
    row: dict[str, Any], reader: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    fmt = FileFormat(validate_chunks([json.dumps(row).encode() + b"\n"] * 2).format)
    if reader in READS[fmt]:
        READERS[reader]([row, row], tokenizer)
    else:
        with pytest.raises(DataError, match="line 1: expected"):
            READERS[reader]([row, row], tokenizer)
