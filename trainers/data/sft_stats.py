"""What an SFT job would train on, before it runs: token counts per epoch, the examples truncation cuts or
drops, the largest micro-batch (which sizes the step's memory) and the first examples as the loss mask
sees them. The same tokenization, masking and truncation as training (``trainers.data.sft``), so the
figures are the trainer's own."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from trainers.data.sft import TokenizedExample, truncated, untruncated_examples

TRUNCATED_LINES_SHOWN = 10


@dataclass
class SFTFileStats:
    examples: int = 0  # rows of the file
    trained_examples: int = 0  # rows with a trainable token left after truncation
    # every input token of the trained examples: what the loop counts as `trained_tokens` (OpenAI's sense)
    tokens_per_epoch: int = 0
    loss_tokens_per_epoch: int = 0  # the loss positions
    truncated: int = 0  # rows longer than max_length
    truncated_lines: list[int] = field(default_factory=list)  # the first TRUNCATED_LINES_SHOWN of them
    dropped_lines: list[int] = field(default_factory=list)  # rows left with nothing to train on
    longest: int = 0  # tokens of the longest trained example, as trained
    # the most trained tokens of any `batch_size` examples (a min-heap of the largest counts)
    top_trained: list[int] = field(default_factory=list)
    preview: list[list[dict[str, Any]]] = field(default_factory=list)

    def largest_micro_batch(self, batch_size: int) -> tuple[int, int, int]:
        """(rows, padded width, trained tokens) bounding any micro-batch of ``batch_size`` examples: the
        longest example sets the width, the ones with the most trained tokens the targets."""
        rows = min(batch_size, max(1, self.trained_examples))
        return rows, max(1, self.longest), max(1, sum(self.top_trained))

    def as_dict(self) -> dict[str, Any]:
        return {
            "examples": self.examples,
            "trained_examples": self.trained_examples,
            "tokens_per_epoch": self.tokens_per_epoch,
            "loss_tokens_per_epoch": self.loss_tokens_per_epoch,
            "truncated": self.truncated,
            "truncated_lines": self.truncated_lines,
            "dropped_lines": self.dropped_lines,
            "preview": self.preview,
        }


def marked_spans(example: TokenizedExample, tokenizer: PreTrainedTokenizerBase) -> list[dict[str, Any]]:
    """The example's text in runs of tokens that train (``trained: true``) or not, each run decoded."""
    spans: list[dict[str, Any]] = []
    start = 0
    mask = example.loss_mask
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            text = tokenizer.decode(example.input_ids[start:i], skip_special_tokens=False)
            spans.append({"text": text, "trained": bool(mask[start]), "tokens": i - start})
            start = i
    return spans


def sft_file_stats(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    batch_size: int,
    preview: int = 3,
    param: str = "training_file",
) -> SFTFileStats:
    """Walk every row once; ``DataError`` as training would raise it on a malformed row."""
    stats = SFTFileStats()
    for line, full in untruncated_examples(rows, tokenizer, param=param):
        stats.examples += 1
        if len(full.input_ids) > max_length:
            stats.truncated += 1
            if len(stats.truncated_lines) < TRUNCATED_LINES_SHOWN:
                stats.truncated_lines.append(line)
        example = truncated(full, max_length)
        if example.n_trainable == 0:
            if len(stats.dropped_lines) < TRUNCATED_LINES_SHOWN:
                stats.dropped_lines.append(line)
            continue
        stats.trained_examples += 1
        stats.tokens_per_epoch += len(example.input_ids)
        stats.loss_tokens_per_epoch += example.n_trainable
        stats.longest = max(stats.longest, len(example.input_ids))
        if len(stats.top_trained) < batch_size:
            heapq.heappush(stats.top_trained, example.n_trainable)
        else:
            heapq.heappushpop(stats.top_trained, example.n_trainable)
        if len(stats.preview) < preview:
            stats.preview.append(marked_spans(example, tokenizer))
    return stats
