"""The pre-flight estimate's file statistics (trainers/data/file_stats.py) are the trainer's own counts:
the tokens, loss tokens and widths of the batches training builds from the same file, and the rows
truncation cuts or drops, by line."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from tests.trainers.methods.test_reward_model import separable_rows
from trainers.data.file_stats import pair_file_stats
from trainers.data.preference import collate_preferences, tokenize_preference_rows

WORDS = " ".join(f"word{i}" for i in range(30))
ROWS: list[dict[str, Any]] = [
    *separable_rows(5),
    {"prompt": "Count.", "chosen": WORDS, "rejected": "No."},  # line 6: its chosen answer is cut
    {"prompt": WORDS, "chosen": "Yes.", "rejected": "No."},  # line 7: its prompt leaves no room
]


@pytest.mark.parametrize("max_prompt_length", [None, 16])
def test_pair_stats_count_what_the_training_batches_hold(
    tokenizer: PreTrainedTokenizerBase, max_prompt_length: int | None
) -> None:
    limits = {"max_length": 32, "max_prompt_length": max_prompt_length}
    stats = pair_file_stats(ROWS, tokenizer, batch_size=2, preview=1, **limits)
    store = tokenize_preference_rows(ROWS, tokenizer, **limits)
    pad = tokenizer.pad_token_id or 0
    batches = [collate_preferences([store[i]], pad_token_id=pad) for i in range(len(store))]
    assert stats.examples == 7 and stats.trained_examples == len(store)
    assert stats.tokens_per_epoch == sum(b.n_tokens for b in batches)  # the loop's trained_tokens
    assert stats.loss_tokens_per_epoch == sum(int(b.completion_mask.sum()) for b in batches)
    assert stats.longest == max(b.input_ids.shape[1] for b in batches)
    if max_prompt_length is None:  # the long prompt fills max_length: the pair is dropped
        assert (stats.truncated, stats.truncated_lines, stats.dropped_lines) == (2, [6, 7], [7])
    else:  # its prompt is cut to its last 16 tokens, which leaves room for the answers
        assert (stats.truncated, stats.truncated_lines, stats.dropped_lines) == (2, [6, 7], [])
    rows, width, targets = stats.largest_micro_batch()
    assert (rows, width) == (4, stats.longest)  # two pairs: four sequences
    assert targets == max(
        int(a.completion_mask.sum()) + int(b.completion_mask.sum())
        for i, a in enumerate(batches)
        for b in batches[i + 1 :]
    )
    # the first pair as its two sequences: the prompt untrained, each answer trained
    chosen, rejected = stats.preview
    for spans, answer in ((chosen, ROWS[0]["chosen"]), (rejected, ROWS[0]["rejected"])):
        assert answer.strip() in "".join(s["text"] for s in spans if s["trained"])
        assert ROWS[0]["prompt"] in "".join(s["text"] for s in spans if not s["trained"])
        assert sum(s["tokens"] for s in spans) == len(store[0].prompt_ids) + len(
            store[0].chosen_ids if spans is chosen else store[0].rejected_ids
        )
