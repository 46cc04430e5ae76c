"""trainers.data.example_store: tokenized examples spilled to memory-mapped files and read back by index."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from transformers import PreTrainedTokenizerBase

from trainers.data.example_store import ExampleStore, ExampleWriter
from trainers.data.preference import PreferenceExample
from trainers.data.sft import TokenizedExample, tokenize_sft_rows
from trainers.data.unpaired import UnpairedExample
from trainers.families.rollout import RLPrompt


def _store(examples: list) -> ExampleStore:  # type: ignore[type-arg]
    writer = ExampleWriter(type(examples[0]))
    for example in examples:
        writer.append(example)
    return writer.finish()


def test_every_kind_of_field_comes_back_as_written() -> None:
    pairs = [
        PreferenceExample([1, 2], [3], [4, 5, 6], margin=0.5),
        PreferenceExample([7], [8, 9], [10], ref_chosen_logp=-1.25, ref_rejected_logp=-3.5),
        PreferenceExample([2**31 - 1], [0], [11], margin=-2.0, ref_chosen_logp=0.0, ref_rejected_logp=None),
    ]
    assert list(_store(pairs)) == pairs  # None stays None, 0.0 stays 0.0, the largest int32 id survives
    unpaired = [UnpairedExample([1], [2, 3], True), UnpairedExample([4, 5], [6], False)]
    assert list(_store(unpaired)) == unpaired
    sft = [TokenizedExample([5, 6, 7], [False, True, True]), TokenizedExample([8, 9], [False, False])]
    back = _store(sft)
    assert list(back) == sft
    assert all(type(flag) is bool for flag in back[0].loss_mask)
    assert back.n_tokens == 5  # ids only, not the mask
    # RL prompts: text and the row's other fields (JSON), unicode and nesting included
    prompts = [
        RLPrompt("Où est Lima ?", [1, 2], {"answer": "Pérou", "tags": ["a", {"n": 1.5}], "none": None}),
        RLPrompt("", [3], {}),
    ]
    assert list(_store(prompts)) == prompts


@dataclass(frozen=True)
class Counted:
    ids: list[int]
    count: int
    weight: float


def test_int_and_float_scalars_keep_their_exact_values() -> None:
    examples = [Counted([1], 2**60 + 1, 0.1), Counted([], -3, -1e300)]
    store = _store(examples)
    assert list(store) == examples
    assert all(type(e.count) is int and type(e.weight) is float for e in store)


def test_the_store_is_read_only(tmp_path: Path) -> None:
    store = _store([TokenizedExample([5, 6, 7], [False, True, True])])
    flat, _ = store._ids["input_ids"]
    assert not flat.flags.writeable


def test_indexing_follows_sequence_rules() -> None:
    examples = [UnpairedExample([i], [i + 1, i + 2], i % 2 == 0) for i in range(5)]
    store = _store(examples)
    assert len(store) == 5
    assert store[-1] == examples[-1] and store[-5] == examples[0]
    assert store[1:4] == examples[1:4] and store[::2] == examples[::2] and store[3:1] == []
    for bad in (5, -6):
        with pytest.raises(IndexError, match=f"example {bad} of 5"):
            store[bad]


def test_empty_lists_and_an_empty_store() -> None:
    # a column whose examples are all empty has no file to map
    store = _store([TokenizedExample([], []), TokenizedExample([], [])])
    assert list(store) == [TokenizedExample([], []), TokenizedExample([], [])]
    assert len(ExampleWriter(TokenizedExample).finish()) == 0


def test_ids_are_on_disk_in_an_unlinked_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    store = _store([TokenizedExample(list(range(1000)), [True] * 1000)])
    flat, _ = store._ids["input_ids"]
    assert isinstance(flat, np.memmap)
    assert list(tmp_path.iterdir()) == []  # nothing to clean up, even after a crash


def test_values_that_do_not_fit_are_refused() -> None:
    writer = ExampleWriter(TokenizedExample)
    with pytest.raises(ValueError, match=r"input_ids: values must lie in \[0, 2147483647\]"):
        writer.append(TokenizedExample([2**31], [True]))
    with pytest.raises(ValueError, match="input_ids: values must lie"):
        writer.append(TokenizedExample([-1], [True]))


def test_a_field_type_it_cannot_store_is_refused_up_front() -> None:
    @dataclass(frozen=True)
    class Tagged:
        ids: list[int]
        tag: tuple[str, str]

    with pytest.raises(TypeError, match=r"Tagged\.tag: an ExampleStore cannot hold tuple\[str, str\]"):
        ExampleWriter(Tagged)


def test_the_sft_tokenizer_returns_a_store(tokenizer: PreTrainedTokenizerBase) -> None:
    rows = [{"prompt": "hi", "completion": " there"}, {"prompt": "a longer prompt", "completion": " b"}]
    examples = tokenize_sft_rows(rows, tokenizer, max_length=64)
    assert isinstance(examples, ExampleStore) and len(examples) == 2
    alone = [tokenize_sft_rows([row], tokenizer, max_length=64)[0] for row in rows]
    assert list(examples) == alone and alone[0] != alone[1]
