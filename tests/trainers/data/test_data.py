"""Loss masks for the three SFT row formats, truncation, and data errors that blame the user."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from trainers.core.errors import DataError
from trainers.data.sft import TokenizedExample, tokenize_sft_rows


def trained_text(tokenizer: PreTrainedTokenizerBase, example: TokenizedExample) -> str:
    return tokenizer.decode([t for t, keep in zip(example.input_ids, example.loss_mask, strict=True) if keep])


def one(tokenizer: PreTrainedTokenizerBase, row: dict[str, Any], max_length: int = 1024) -> TokenizedExample:
    [example] = tokenize_sft_rows([row], tokenizer, max_length=max_length)
    return example


CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Lyon.", "weight": 0},
        {"role": "user", "content": "Are you sure?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ]
}


def test_chat_trains_on_assistant_turns_with_weight_one(tokenizer: PreTrainedTokenizerBase) -> None:
    example = one(tokenizer, CHAT)
    assert trained_text(tokenizer, example) == "The capital of France is Paris.<|end|>"
    # The ids are those of the rendered conversation.
    rendered = tokenizer.apply_chat_template(CHAT["messages"], tokenize=False)
    assert tokenizer.decode(example.input_ids) == rendered


def test_chat_without_weights_trains_every_assistant_turn(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{k: v for k, v in m.items() if k != "weight"} for m in CHAT["messages"]]
    example = one(tokenizer, {"messages": messages})
    assert trained_text(tokenizer, example) == "Lyon.<|end|>The capital of France is Paris.<|end|>"


def test_prompt_completion_trains_on_completion_and_eos(tokenizer: PreTrainedTokenizerBase) -> None:
    example = one(tokenizer, {"prompt": "Q: capital of Peru?\nA:", "completion": " Lima."})
    assert trained_text(tokenizer, example) == " Lima.<|end|>"
    assert example.input_ids[0] == tokenizer.bos_token_id


def test_prompt_completion_as_messages(tokenizer: PreTrainedTokenizerBase) -> None:
    row = {
        "prompt": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Capital of Peru?"},
        ],
        "completion": [{"role": "assistant", "content": "Lima."}],
    }
    assert trained_text(tokenizer, one(tokenizer, row)) == "Lima.<|end|>"


def test_text_trains_on_every_token(tokenizer: PreTrainedTokenizerBase) -> None:
    example = one(tokenizer, {"text": "The robot reads books."})
    assert example.input_ids[0] == tokenizer.bos_token_id
    assert example.loss_mask == [False] + [True] * (len(example.input_ids) - 1)
    assert trained_text(tokenizer, example) == "The robot reads books.<|end|>"


def test_truncation_keeps_the_start(tokenizer: PreTrainedTokenizerBase) -> None:
    full = one(tokenizer, CHAT)
    cut = len(full.input_ids) - 3
    truncated = one(tokenizer, CHAT, max_length=cut)
    assert truncated.input_ids == full.input_ids[:cut]
    assert truncated.loss_mask == full.loss_mask[:cut]
    assert 0 < truncated.n_trainable < full.n_trainable


def test_examples_truncated_to_nothing_are_dropped(tokenizer: PreTrainedTokenizerBase) -> None:
    short = {"prompt": "Hi", "completion": " there"}
    rows = [{"prompt": "A long prompt about the capital of France", "completion": " Paris."}, short]
    kept = tokenize_sft_rows(rows, tokenizer, max_length=6)
    assert [tokenizer.decode(e.input_ids) for e in kept] == ["<|begin|>Hi there<|end|>"]


def test_all_truncated_away_blames_max_length(tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(DataError) as info:
        tokenize_sft_rows([CHAT, CHAT], tokenizer, max_length=8)
    assert info.value.param == "hyperparameters.max_length"
    assert "max_length=8" in info.value.message


def test_no_trainable_tokens_blames_the_file(tokenizer: PreTrainedTokenizerBase) -> None:
    row = {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "weight": 0}]
    }
    with pytest.raises(DataError) as info:
        tokenize_sft_rows([row], tokenizer, max_length=64, param="validation_file")
    assert info.value.param == "validation_file"


@pytest.mark.parametrize(
    ("rows", "needle"),
    [
        ([], "no examples"),
        ([{"input": "x"}], "line 1"),
        ([{"text": "a"}, {"prompt": "b", "completion": "c"}], "line 2"),
        ([{"messages": [{"role": "user", "content": 3}]}], "line 1"),
        ([{"messages": []}], "line 1"),
        ([{"messages": [{"role": "assistant", "content": "x", "weight": 2}]}], "weight"),
        ([{"text": None}], "line 1"),
    ],
)
def test_malformed_rows(tokenizer: PreTrainedTokenizerBase, rows: list[Any], needle: str) -> None:
    with pytest.raises(DataError) as info:
        tokenize_sft_rows(rows, tokenizer, max_length=64)
    assert needle in info.value.message
    assert info.value.param == "training_file"
