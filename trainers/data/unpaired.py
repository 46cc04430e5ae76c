"""Unpaired feedback rows (KTO): parse, tokenize, truncate, collate with mismatched KL pairs.

Each row is one completion judged good or bad, ``"label": true`` (desirable) or ``false`` (undesirable).
Two row formats, detected from the first row and required of every row:

- ``{"prompt", "completion", "label"}`` with strings, or message lists (TRL's unpaired preference
  format; a string next to a message list is read as a user prompt or an assistant answer);
- ``{"messages": [...], "label"}``: a conversation whose last message is the assistant's completion,
  judged by the label; the messages before it are the prompt.

Preference pairs (``trainers.data.preference``'s formats) are also read, as two examples each.

Prompts and completions are rendered as for preference pairs (``trainers.data.preference``): a string
prompt is ``BOS + prompt`` and a string completion ``completion + EOS``; a message prompt is rendered
with the chat template and its generation prompt. Truncation: the prompt to its last
``max_prompt_length`` tokens, then prompt + completion to its first ``max_length``; a row left with no
completion token is dropped.

KTO's reference point is estimated from mismatched pairs (x_i, y_j), i != j: the collate function pairs
each example's prompt with the completion of the example before it in the micro-batch (the first takes
the last's), as TRL's KTO does: (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}), so the mismatched
completions are the batch's own completions, paired with other prompts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from trainers.chat.pairs import unpaired_example
from trainers.core.errors import DataError
from trainers.data.chat import conversation_texts, read_errors
from trainers.data.example_store import ExampleStore, ExampleWriter
from trainers.data.packing import PackedLayout
from trainers.data.preference import (
    SequenceRows,
    _encode,
    pad_sequences,
    tokenize_preference_rows,
)
from trainers.data.sft import _bos_text, _eos_text, first_row_kind, row_errors, rows_of_kind
from trainers.formats import FileFormat, Shape, detect

__all__ = [
    "UnpairedBatch",
    "UnpairedExample",
    "collate_unpaired",
    "tokenize_unpaired_rows",
]


@dataclass(frozen=True)
class UnpairedExample:
    prompt_ids: list[int]
    completion_ids: list[int]  # completion tokens only
    label: bool  # True: desirable


def tokenize_unpaired_rows(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    max_prompt_length: int | None = None,
    param: str = "training_file",
) -> ExampleStore[UnpairedExample]:
    """Tokenize and truncate ``rows`` into an on-disk store; raise ``DataError`` (with ``param``) when
    no usable row remains.

    Preference pairs are accepted too, unpaired as TRL's KTO does: each pair gives a desirable example
    (the chosen completion) and an undesirable one (the rejected completion), with the same prompt.
    """
    if rows and isinstance(rows[0], Mapping) and detect(rows[0]) is FileFormat.PREFERENCE:
        pairs = tokenize_preference_rows(
            rows, tokenizer, max_length=max_length, max_prompt_length=max_prompt_length, param=param
        )
        unpaired = ExampleWriter(UnpairedExample)
        for pair in pairs:
            unpaired.append(UnpairedExample(pair.prompt_ids, pair.chosen_ids, True))
            unpaired.append(UnpairedExample(pair.prompt_ids, pair.rejected_ids, False))
        return unpaired.finish()
    kind = first_row_kind(
        rows,
        frozenset({FileFormat.UNPAIRED_PREFERENCE}),
        expected='{"prompt", "completion", "label"} or {"messages", "label"}',
        param=param,
    )
    bos, eos = _bos_text(tokenizer), _eos_text(tokenizer)
    examples = ExampleWriter(UnpairedExample)
    n_truncated_away = 0
    for line, row in rows_of_kind(rows, kind, param=param):
        with row_errors(line, kind, param=param):
            label = row.get("label")  # a row without one is unpaired feedback missing its label
            if not isinstance(label, bool):
                raise DataError('"label" must be true or false')
            with read_errors():
                read = unpaired_example(row, messages_shape=kind.shape is Shape.MESSAGES_LABEL)
            if read is None:
                prompt_text, completion_text = bos + row["prompt"], row["completion"] + eos
            else:
                prompt_text, [completion_text] = conversation_texts(tokenizer, read)
        prompt_ids, completion_ids = _encode(tokenizer, prompt_text), _encode(tokenizer, completion_text)
        if not completion_ids:
            raise DataError(f"line {line}: the completion must not be empty", param=param)
        if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
            prompt_ids = prompt_ids[len(prompt_ids) - max_prompt_length :]
        completion_ids = completion_ids[: max(max_length - len(prompt_ids), 0)]
        # The first token of a sequence has no context, so a completion needs a prompt token before it.
        if prompt_ids and completion_ids:
            examples.append(UnpairedExample(prompt_ids, completion_ids, label))
        else:
            n_truncated_away += 1
    if not examples:
        if n_truncated_away:
            raise DataError(
                f"every row was truncated away: max_length={max_length} leaves no completion tokens",
                param="hyperparameters.max_length",
            )
        raise DataError("no usable row", param=param)  # pragma: no cover (rows is non-empty)
    return examples.finish()


# -- batches ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UnpairedBatch:
    """B examples (prompt + completion rows) and their B mismatched KL rows."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T] bool
    labels: torch.Tensor  # [B] bool: desirable
    kl: SequenceRows  # [B, T'] rows: prompt i + completion i-1 (mod B)
    n_inputs: int  # real (non-pad) tokens of the B training rows
    packed: PackedLayout | None = None  # never set yet: KTO runs padded
    extra_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # none yet: KTO takes text only

    @property
    def loss_denominator(self) -> int:
        return int(self.labels.numel())  # one loss unit per example

    @property
    def n_tokens(self) -> int:
        return self.n_inputs

    def to(self, device: torch.device) -> UnpairedBatch:
        return replace(
            self,
            input_ids=self.input_ids.to(device, non_blocking=True),
            attention_mask=self.attention_mask.to(device, non_blocking=True),
            completion_mask=self.completion_mask.to(device, non_blocking=True),
            labels=self.labels.to(device, non_blocking=True),
            kl=self.kl.to(device),
        )


def collate_unpaired(
    examples: Sequence[UnpairedExample], *, pad_token_id: int, max_length: int
) -> UnpairedBatch:
    """The examples' rows, and the KL rows pairing prompt i with completion i-1 (the first with the
    last's), each cut to ``max_length`` tokens."""
    main = pad_sequences([(e.prompt_ids, e.completion_ids) for e in examples], pad_token_id=pad_token_id)
    shifted = [examples[-1], *examples[:-1]]
    kl_rows = []
    for example, other in zip(examples, shifted, strict=True):
        room = max(max_length - len(example.prompt_ids), 0)
        kl_rows.append((example.prompt_ids[:max_length], other.completion_ids[:room]))
    return UnpairedBatch(
        input_ids=main.input_ids,
        attention_mask=main.attention_mask,
        completion_mask=main.completion_mask,
        labels=torch.tensor([e.label for e in examples], dtype=torch.bool),
        kl=pad_sequences(kl_rows, pad_token_id=pad_token_id),
        n_inputs=int(main.attention_mask.sum().item()),
    )
