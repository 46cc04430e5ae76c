"""What a job would train on, before it runs: token counts per epoch, the examples truncation cuts or
drops, the largest micro-batch (which sizes the step's memory) and the first examples as the loss sees
them. The same tokenization, masking and truncation as training (``trainers.data.sft`` for SFT files,
``trainers.data.preference`` for preference pairs), so the figures are the trainer's own.

A preference pair trains as two sequences, prompt + chosen and prompt + rejected: its tokens are both
sequences' (what the loop counts as ``trained_tokens``), its loss tokens their completions' (whose
log-probabilities the pair losses sum; a reward model scores each sequence at its last token), and its
preview is the two sequences, the chosen first.

With images (a vision base, ``trainers.data.vision``), the counts are the processor's: each image's tokens
are in the sequence's tokens, ``image_tokens_per_epoch`` counts those that take its features (a pair's
twice: both sequences carry the prompt), and the preview shows each image where it stands, as one span
``{"text": "[image k]", "trained": false, "tokens": n, "image": k - 1}``."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from trainers.data.preference import VisionPair, tokenized_pairs
from trainers.data.sft import TokenizedExample, truncated, untruncated_examples
from trainers.data.vision import VisionData, VisionExample

TRUNCATED_LINES_SHOWN = 10


@dataclass
class FileStats:
    examples: int = 0  # rows of the file
    sequences_per_example: int = 1  # a preference pair: 2
    # the examples the loop batches with a trainable token left after truncation: rows, or for an SFT
    # conversation its template renders in several sequences, each sequence
    trained_examples: int = 0
    # every input token of the trained examples: what the loop counts as `trained_tokens` (OpenAI's sense)
    tokens_per_epoch: int = 0
    loss_tokens_per_epoch: int = 0  # the loss positions
    truncated: int = 0  # rows truncation cut (longer than max_length; or a prompt over max_prompt_length)
    truncated_lines: list[int] = field(default_factory=list)  # the first TRUNCATED_LINES_SHOWN of them
    dropped_lines: list[int] = field(default_factory=list)  # rows left with nothing to train on
    longest: int = 0  # tokens of the longest trained sequence, as trained
    # the most trained tokens of any `batch_size` examples (a min-heap of the largest counts)
    top_trained: list[int] = field(default_factory=list)
    preview: list[list[dict[str, Any]]] = field(default_factory=list)
    batch_size: int = 1  # examples per micro-batch: how many `top_trained` keeps
    images_per_epoch: int = 0  # images of the trained examples (a vision base's)
    image_tokens_per_epoch: int = 0  # their tokens that take image features
    most_image_tokens: int = 0  # of any one trained sequence

    def count_images(self, images: int, tokens: int, sequences: int = 1) -> None:
        self.images_per_epoch += images
        self.image_tokens_per_epoch += tokens * sequences
        self.most_image_tokens = max(self.most_image_tokens, tokens)

    def largest_micro_batch_images(self) -> int:
        """Image tokens bounding any micro-batch's: each of its rows with the most any sequence has."""
        return self.largest_micro_batch()[0] * self.most_image_tokens

    def largest_micro_batch(self) -> tuple[int, int, int]:
        """(rows, padded width, trained tokens) bounding any micro-batch of ``batch_size`` examples:
        the longest sequence sets the width, the examples with the most trained tokens the targets."""
        rows = min(self.batch_size, max(1, self.trained_examples)) * self.sequences_per_example
        return rows, max(1, self.longest), max(1, sum(self.top_trained))

    def count_trained(self, tokens: int, loss_tokens: int, longest: int) -> None:
        self.trained_examples += 1
        self.tokens_per_epoch += tokens
        self.loss_tokens_per_epoch += loss_tokens
        self.longest = max(self.longest, longest)
        if len(self.top_trained) < self.batch_size:
            heapq.heappush(self.top_trained, loss_tokens)
        else:
            heapq.heappushpop(self.top_trained, loss_tokens)

    def count_cut(self, line: int) -> None:
        self.truncated += 1
        if len(self.truncated_lines) < TRUNCATED_LINES_SHOWN:
            self.truncated_lines.append(line)

    def count_dropped(self, line: int) -> None:
        if len(self.dropped_lines) < TRUNCATED_LINES_SHOWN:
            self.dropped_lines.append(line)

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
            "images_per_epoch": self.images_per_epoch,
            "image_tokens_per_epoch": self.image_tokens_per_epoch,
        }


def marked_spans(
    example: TokenizedExample, tokenizer: PreTrainedTokenizerBase, vision: VisionData | None = None
) -> list[dict[str, Any]]:
    """The example's text in runs of tokens that train (``trained: true``) or not, each run decoded, and
    each image as a span of its own (``vision``'s ``image_spans``)."""
    images = vision.image_spans(example) if vision is not None and isinstance(example, VisionExample) else []
    return _spans(example.input_ids, [bool(m) for m in example.loss_mask], tokenizer, images)


def _spans(
    ids: list[int],
    trained: list[bool],
    tokenizer: PreTrainedTokenizerBase,
    images: Sequence[tuple[int, int]] = (),
) -> list[dict[str, Any]]:
    image_of = {start: (k, end) for k, (start, end) in enumerate(images)}
    spans: list[dict[str, Any]] = []
    start = i = 0
    while i < len(trained):
        if i in image_of:
            if i > start:
                spans += _text_spans(ids, trained, tokenizer, start, i)
            k, end = image_of[i]
            spans.append({"text": f"[image {k + 1}]", "trained": False, "tokens": end - i, "image": k})
            start = i = end
        else:
            i += 1
    return spans + _text_spans(ids, trained, tokenizer, start, len(trained))


def _text_spans(
    ids: list[int], trained: list[bool], tokenizer: PreTrainedTokenizerBase, first: int, last: int
) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    start = first
    for i in range(first + 1, last + 1):
        if i == last or trained[i] != trained[start]:
            text = tokenizer.decode(ids[start:i], skip_special_tokens=False)
            spans.append({"text": text, "trained": trained[start], "tokens": i - start})
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
    vision: VisionData | None = None,
) -> FileStats:
    """Walk every row of an SFT file once; ``DataError`` as training would raise it on a malformed row.
    ``vision``: a vision base's processor (rows with images)."""
    stats = FileStats(batch_size=batch_size)
    last_line = 0
    for line, full in untruncated_examples(rows, tokenizer, param=param, vision=vision):
        # a conversation whose template renders earlier turns differently trains as several sequences
        # (trainers.data.chat): each is an example of the loop's batches, the row is one of the file's
        stats.examples += line != last_line
        last_line = line
        if len(full.input_ids) > max_length:
            stats.count_cut(line)
        example = truncated(full, max_length)
        if example.n_trainable == 0:
            stats.count_dropped(line)
            continue
        stats.count_trained(len(example.input_ids), example.n_trainable, len(example.input_ids))
        if vision is not None and isinstance(example, VisionExample):
            stats.count_images(len(example.images), vision.image_tokens(example))
        if len(stats.preview) < preview:
            stats.preview.append(marked_spans(example, tokenizer, vision))
    return stats


def pair_file_stats(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    max_prompt_length: int | None,
    batch_size: int,
    preview: int = 3,
    param: str = "training_file",
    vision: VisionData | None = None,
) -> FileStats:
    """Walk every row of a preference file once (the module's docstring says how a pair counts);
    ``DataError`` as training would raise it on a malformed row. ``vision``: a vision base's processor."""
    stats = FileStats(sequences_per_example=2, batch_size=batch_size)
    for pair in tokenized_pairs(
        rows,
        tokenizer,
        max_length=max_length,
        max_prompt_length=max_prompt_length,
        param=param,
        vision=vision,
    ):
        stats.examples += 1
        if pair.cut:
            stats.count_cut(pair.line)
        if pair.example is None:
            stats.count_dropped(pair.line)
            continue
        prompt, completions = pair.example.prompt_ids, (pair.example.chosen_ids, pair.example.rejected_ids)
        stats.count_trained(
            sum(len(prompt) + len(c) for c in completions),
            sum(len(c) for c in completions),
            max(len(prompt) + len(c) for c in completions),
        )
        example = pair.example
        if vision is not None and isinstance(example, VisionPair):
            chosen, _ = example.sequences()
            stats.count_images(len(example.vision["images"]), vision.image_tokens(chosen), sequences=2)
        for sequence in example.sequences():
            if len(stats.preview) < 2 * preview:
                stats.preview.append(marked_spans(sequence, tokenizer, vision))
    return stats
