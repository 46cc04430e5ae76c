"""Preference rows (DPO, reward models): parse, tokenize, truncate, collate.

Two row formats, detected from the first row and required of every row:

- OpenAI's ``{"input": {"messages": [...]}, "preferred_output": [...], "non_preferred_output": [...]}``,
  the outputs being lists of assistant messages;
- ``{"prompt", "chosen", "rejected"}`` with strings, or message lists (a string next to a message list
  is read as a user prompt or an assistant answer).

A message-shaped prompt is rendered with the chat template and its generation prompt; the completion is
what rendering prompt + completion adds after it. A string prompt is ``BOS + prompt`` and a string
completion ``completion + EOS``, as for SFT rows. Prompt and completions are tokenized separately, so the
prompt is tokenized exactly as at inference time, and only completion tokens are loss targets.

Truncation: the prompt first, to its last ``max_prompt_length`` tokens (the end of a prompt, with the
generation prompt, is what the completion depends on most); then each of prompt + chosen and prompt +
rejected to its first ``max_length`` tokens. A pair left with no chosen or no rejected token is dropped.
An optional numeric ``"margin"`` per row is kept (the reward model's margin, Touvron et al. 2023, eq. 2).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from trainers.chat.pairs import preference_pair
from trainers.chat.rows import ImageRef
from trainers.core.errors import DataError
from trainers.data.chat import conversation_texts, read_errors
from trainers.data.collate import BatchInputs
from trainers.data.example_store import ExampleStore, ExampleWriter
from trainers.data.packing import PackedLayout, PairPacking, pack_layout, shared_prompt_layout
from trainers.data.sft import (
    ImageTokenizer,
    TokenizedExample,
    _bos_text,
    _eos_text,
    first_row_kind,
    require_vision,
    row_errors,
    rows_of_kind,
)
from trainers.data.vision import VisionExample
from trainers.formats import FileFormat, Shape

__all__ = [
    "PreferenceBatch",
    "PreferenceExample",
    "SequenceRows",
    "TokenizedPair",
    "collate_preferences",
    "encode_prompt_completion",
    "pad_sequences",
    "stack_rows",
    "tokenize_preference_rows",
    "tokenized_pairs",
]


@dataclass(frozen=True)
class PreferenceExample:
    """One tokenized pair; the completions hold completion tokens only (their prompt is ``prompt_ids``)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float = 0.0
    ref_chosen_logp: float | None = None  # reference log-probs, when precomputed (DPO)
    ref_rejected_logp: float | None = None

    def with_ref_logps(self, chosen: float, rejected: float) -> PreferenceExample:
        return replace(self, ref_chosen_logp=chosen, ref_rejected_logp=rejected)

    def sequences(self) -> tuple[TokenizedExample, TokenizedExample]:
        """prompt + chosen and prompt + rejected as SFT-shaped examples (the completions trained)."""
        return (
            TokenizedExample(
                self.prompt_ids + self.chosen_ids,
                [False] * len(self.prompt_ids) + [True] * len(self.chosen_ids),
            ),
            TokenizedExample(
                self.prompt_ids + self.rejected_ids,
                [False] * len(self.prompt_ids) + [True] * len(self.rejected_ids),
            ),
        )


@dataclass(frozen=True)
class VisionPair(PreferenceExample):
    """A pair whose prompt holds images (a vision base's rows): the prompt's per-token types and its
    images as ``trainers.data.vision.VisionExample`` keeps them (defaults: a pair without images)."""

    prompt_types: list[int] = field(default_factory=list)
    vision: dict[str, Any] = field(default_factory=lambda: {"images": [], "segments": []})

    def sequences(self) -> tuple[TokenizedExample, TokenizedExample]:
        def row(completion: list[int]) -> TokenizedExample:
            types = (self.prompt_types or [0] * len(self.prompt_ids)) + [0] * len(completion)
            mask = [False] * len(self.prompt_ids) + [True] * len(completion)
            return VisionExample(self.prompt_ids + completion, mask, types, self.vision)

        return row(self.chosen_ids), row(self.rejected_ids)


@dataclass(frozen=True)
class TokenizedPair:
    """One row of a preference file as training reads it (``tokenized_pairs``)."""

    line: int  # the row's line in its file, from 1
    example: PreferenceExample | None  # None: truncated away (no prompt, chosen or rejected token left)
    cut: bool  # truncation removed tokens from the prompt or a completion


def tokenized_pairs(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    max_prompt_length: int | None = None,
    param: str = "training_file",
    vision: ImageTokenizer | None = None,
) -> Iterator[TokenizedPair]:
    """Each row tokenized and truncated (the module's docstring); ``DataError`` (with ``param``) on a
    malformed row. What training reads (``tokenize_preference_rows``) and the pre-flight estimate counts
    (``trainers.data.file_stats``). A prompt with images goes through ``vision`` (``VisionPair``s); the
    prompt's cut to ``max_prompt_length`` may not reach into its images."""
    kind = first_row_kind(
        rows,
        frozenset({FileFormat.PREFERENCE}),
        expected='{"input", "preferred_output", "non_preferred_output"} or {"prompt", "chosen", "rejected"}',
        param=param,
    )
    bos, eos = _bos_text(tokenizer), _eos_text(tokenizer)
    for line, row in rows_of_kind(rows, kind, param=param):
        with row_errors(line, kind, param=param):
            prompt, chosen, rejected, images = _texts(row, kind.shape, tokenizer, bos, eos, vision)
            margin = _margin(row.get("margin", 0.0))
            prompt_part = vision.tokenize([(prompt, False)], images) if vision is not None else None
        prompt_ids = _encode(tokenizer, prompt) if prompt_part is None else prompt_part.input_ids
        chosen_ids, rejected_ids = _encode(tokenizer, chosen), _encode(tokenizer, rejected)
        if not chosen_ids or not rejected_ids:
            raise DataError(
                f"line {line}: the chosen and rejected completions must not be empty", param=param
            )
        full = len(prompt_ids) + max(len(chosen_ids), len(rejected_ids))
        if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
            if isinstance(prompt_part, VisionExample) and prompt_part.vision["images"]:
                raise DataError(
                    f"line {line}: the prompt with its images is {len(prompt_ids)} tokens, more than "
                    f"max_prompt_length={max_prompt_length} (a prompt's images are never cut)",
                    param="hyperparameters.max_prompt_length",
                )
            prompt_ids = prompt_ids[len(prompt_ids) - max_prompt_length :]
        room = max_length - len(prompt_ids)
        completions = chosen_ids[: max(room, 0)], rejected_ids[: max(room, 0)]
        example: PreferenceExample = (
            VisionPair(
                prompt_ids, *completions, margin, None, None, prompt_part.token_types, prompt_part.vision
            )
            if isinstance(prompt_part, VisionExample)
            else PreferenceExample(prompt_ids, *completions, margin)
        )
        kept = len(example.prompt_ids) + max(len(example.chosen_ids), len(example.rejected_ids))
        # The first token of a sequence has no context, so a completion needs a prompt token before it.
        usable = bool(prompt_ids and example.chosen_ids and example.rejected_ids)
        yield TokenizedPair(line, example if usable else None, cut=kept < full)


def tokenize_preference_rows(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    max_prompt_length: int | None = None,
    param: str = "training_file",
    vision: ImageTokenizer | None = None,
) -> ExampleStore[PreferenceExample]:
    """Tokenize and truncate ``rows`` into an on-disk store (of ``VisionPair``s where the model takes
    images); raise ``DataError`` (with ``param``) when no usable pair remains."""
    examples = ExampleWriter(VisionPair if vision is not None else PreferenceExample)
    n_truncated_away = 0
    for pair in tokenized_pairs(
        rows,
        tokenizer,
        max_length=max_length,
        max_prompt_length=max_prompt_length,
        param=param,
        vision=vision,
    ):
        if pair.example is not None:
            examples.append(pair.example)
        else:
            n_truncated_away += 1
    if not examples:
        if n_truncated_away:
            raise DataError(
                f"every pair was truncated away: max_length={max_length} leaves no completion tokens",
                param="hyperparameters.max_length",
            )
        raise DataError("no usable preference pair", param=param)  # pragma: no cover (rows is non-empty)
    return examples.finish()


def encode_prompt_completion(
    tokenizer: PreTrainedTokenizerBase, prompt: str, completion: str, *, max_length: int
) -> list[int]:
    """Token ids of a plain-text ``prompt`` + ``completion`` as training renders string rows, truncated.

    A prompt already rendered by the chat template (starting with the BOS text) gets no second BOS; a
    completion gets EOS appended unless it ends with it (generated text usually stops before EOS).
    """
    bos, eos = _bos_text(tokenizer), _eos_text(tokenizer)
    if bos and not prompt.startswith(bos):
        prompt = bos + prompt
    if eos and not completion.endswith(eos):
        completion = completion + eos
    return (_encode(tokenizer, prompt) + _encode(tokenizer, completion))[:max_length]


# -- batches ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreferenceBatch:
    """B pairs as one batch of 2B right-padded rows: the B chosen sequences, then the B rejected ones.

    ``packed``, when set, is where the decoder runs: the 2B rows' real tokens packed into fewer rows
    (``trainers.data.packing``); what it returns is unpacked to the [2B, T] layout the losses read."""

    input_ids: torch.Tensor  # [2B, T]
    attention_mask: torch.Tensor  # [2B, T]
    completion_mask: torch.Tensor  # [2B, T] bool: token t is a completion token (a target)
    margins: torch.Tensor  # [B] float32
    ref_chosen_logps: torch.Tensor | None  # [B] float32, when precomputed
    ref_rejected_logps: torch.Tensor | None
    n_pairs: int
    n_inputs: int  # real (non-pad) tokens of the 2B rows
    packed: PackedLayout | None = None
    # the 2B rows' other inputs: a vision model's pixels, per-token types (``trainers.data.vision``)
    extra_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def loss_denominator(self) -> int:
        return self.n_pairs  # one loss unit per pair

    @property
    def n_tokens(self) -> int:
        return self.n_inputs

    def to(self, device: torch.device) -> PreferenceBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return replace(
            self,
            input_ids=self.input_ids.to(device, non_blocking=True),
            attention_mask=self.attention_mask.to(device, non_blocking=True),
            completion_mask=self.completion_mask.to(device, non_blocking=True),
            margins=self.margins.to(device, non_blocking=True),
            ref_chosen_logps=move(self.ref_chosen_logps),
            ref_rejected_logps=move(self.ref_rejected_logps),
            packed=self.packed.to(device) if self.packed is not None else None,
            extra_inputs={k: v.to(device, non_blocking=True) for k, v in self.extra_inputs.items()},
        )


@dataclass(frozen=True)
class SequenceRows:
    """Right-padded prompt + completion rows."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T] bool: token t is a completion token (a target)
    packed: PackedLayout | None = None  # never set yet: KTO's and online DPO's rows run padded
    extra_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # none yet: text only

    def to(self, device: torch.device) -> SequenceRows:
        return SequenceRows(
            self.input_ids.to(device, non_blocking=True),
            self.attention_mask.to(device, non_blocking=True),
            self.completion_mask.to(device, non_blocking=True),
        )


def stack_rows(first: SequenceRows, second: SequenceRows) -> SequenceRows:
    """``first``'s rows then ``second``'s, right-padded to the wider (pad positions are masked out, so
    their token id does not matter: 0)."""
    width = max(first.input_ids.shape[1], second.input_ids.shape[1])

    def stack(name: str) -> torch.Tensor:
        parts = [getattr(rows, name) for rows in (first, second)]
        return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in parts])

    return SequenceRows(stack("input_ids"), stack("attention_mask"), stack("completion_mask"))


def pad_sequences(rows: Sequence[tuple[list[int], list[int]]], *, pad_token_id: int) -> SequenceRows:
    """Right-pad (prompt, completion) token lists to the longest row."""
    width = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    completion_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (prompt, completion) in enumerate(rows):
        n = len(prompt) + len(completion)
        input_ids[i, :n] = torch.tensor(prompt + completion)
        attention_mask[i, :n] = 1
        completion_mask[i, len(prompt) : n] = True
    return SequenceRows(input_ids, attention_mask, completion_mask)


def collate_preferences(
    examples: Sequence[PreferenceExample],
    *,
    pad_token_id: int,
    pack: PairPacking = PairPacking.PADDED,
    inputs: BatchInputs | None = None,
) -> PreferenceBatch:
    """Right-pad prompt + chosen and prompt + rejected of every pair to the longest of the 2B rows; unless
    ``pack`` is ``PADDED``, also lay them out packed (``PreferenceBatch.packed``): as sequences into rows
    no longer than the longest, or with each pair's prompt once into rows no longer than the longest of
    those and the longest pair.

    Rows of the batch's own width rather than ``max_length``: on the CPU, SmolLM2's reward-model step over
    8 pairs (16 rows of up to 210 tokens, 66% of them real) took 14.1 s padded, 10.1 s packed into 12
    rows of 210 and 11.7 s packed into 5 rows of 512 (attention over the wider rows costs more than the
    few pad slots it saves). ``inputs``: the rows' other model inputs (a vision model's pixels; padded
    rows only)."""
    sequences = [(e.prompt_ids, e.chosen_ids) for e in examples] + [
        (e.prompt_ids, e.rejected_ids) for e in examples
    ]
    rows = pad_sequences(sequences, pad_token_id=pad_token_id)
    width = rows.input_ids.shape[1]
    packed = None
    if pack is PairPacking.SEQUENCES:
        packed = pack_layout([len(p) + len(c) for p, c in sequences], width, capacity=width)
    elif pack is PairPacking.SHARED_PROMPTS:
        packed = shared_prompt_layout(
            [len(e.prompt_ids) for e in examples],
            [(len(e.chosen_ids), len(e.rejected_ids)) for e in examples],
            [(i, len(examples) + i) for i in range(len(examples))],  # the chosen rows, then the rejected
            width,
        )
    precomputed = all(e.ref_chosen_logp is not None and e.ref_rejected_logp is not None for e in examples)
    return PreferenceBatch(
        input_ids=rows.input_ids,
        attention_mask=rows.attention_mask,
        completion_mask=rows.completion_mask,
        margins=torch.tensor([e.margin for e in examples], dtype=torch.float32),
        ref_chosen_logps=torch.tensor([e.ref_chosen_logp for e in examples]) if precomputed else None,
        ref_rejected_logps=torch.tensor([e.ref_rejected_logp for e in examples]) if precomputed else None,
        n_pairs=len(examples),
        n_inputs=int(rows.attention_mask.sum().item()),
        packed=packed,
        extra_inputs=_extra_inputs(examples, inputs, width) if inputs is not None else {},
    )


def _extra_inputs(
    examples: Sequence[PreferenceExample], inputs: BatchInputs, width: int
) -> dict[str, torch.Tensor]:
    """The 2B rows' other inputs: the chosen rows', then the rejected rows' (each pair's prompt, images
    included, in both)."""
    rows = [e.sequences() for e in examples]
    return inputs.batch_inputs([c for c, _ in rows] + [r for _, r in rows], width)


# -- rows -> texts ------------------------------------------------------------------------------------


def _texts(
    row: Mapping[str, Any],
    shape: Shape | None,
    tokenizer: PreTrainedTokenizerBase,
    bos: str,
    eos: str,
    vision: ImageTokenizer | None,
) -> tuple[str, str, str, list[ImageRef]]:
    """(prompt, chosen completion, rejected completion) as text, and the prompt's images: a text pair's
    strings with BOS and EOS, or the conversations rendered by the chat template
    (``trainers.chat.pairs``)."""
    with read_errors():
        read = preference_pair(row, openai_shape=shape is Shape.OPENAI_PREFERENCE)
    if read is None:
        return bos + row["prompt"], row["chosen"] + eos, row["rejected"] + eos, []
    require_vision(read[0].images, vision)
    prompt_text, (chosen_text, rejected_text) = conversation_texts(tokenizer, read)
    return prompt_text, chosen_text, rejected_text, read[0].images


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    if not text:
        return []
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert isinstance(ids, list)
    return [int(i) for i in ids]


def _margin(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise DataError('"margin" must be a finite number')
    return float(value)
