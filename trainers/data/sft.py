"""Turn SFT rows into token ids plus a per-token loss mask.

Three row formats (``trainers.formats``: the rule the upload validator uses too), detected from the first
row and required of every row:

- chat ``{"messages": [...], "tools": [...]}`` (OpenAI's chat row, ``trainers.chat.rows``): rendered by
  the model's own chat template with everything it holds (tool calls, tool results, reasoning, the
  tools' schemas); loss on the assistant turns with weight 1 (the default), each exactly as the model
  produces it at inference time. A conversation whose template renders earlier turns differently once
  later ones follow trains as several sequences, one per such turn (``trainers.data.chat`` says how).
- ``{"prompt", "completion"}``: loss on the completion (plus EOS) only. Message lists are accepted too
  and treated as a chat whose prompt turns carry no loss.
- ``{"text"}``: loss on every token (plus EOS), for continued pre-training.

Each segment is tokenized on its own, so a prompt is tokenized exactly as it is at inference time.
Examples (sequences) are truncated to ``max_length``; those left with no trainable token are dropped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from trainers.chat.rows import Conversation, ImageRef, continue_chat, read_chat
from trainers.core.errors import DataError
from trainers.data.chat import ChatDataError, Segment, read_errors, training_sequences
from trainers.data.example_store import ExampleStore, ExampleWriter
from trainers.formats import SFT_FORMATS, FileFormat, Shape, detect, shape


@dataclass(frozen=True)
class TokenizedExample:
    """``loss_mask[i]``: whether ``input_ids[i]`` is a training target, predicted from ``input_ids[:i]``."""

    input_ids: list[int]
    loss_mask: list[bool]

    @property
    def n_trainable(self) -> int:
        return sum(self.loss_mask[1:])  # the first token has no context, so it is never a target

    def truncated(self, max_length: int) -> TokenizedExample:
        """What training keeps: the first ``max_length`` tokens (kept if one still trains)."""
        return TokenizedExample(self.input_ids[:max_length], self.loss_mask[:max_length])


class ImageTokenizer(Protocol):
    """Tokenizes segments, with images, through the model's processor (``trainers.data.vision``), into
    examples of ``example_type``."""

    @property
    def example_type(self) -> type[TokenizedExample]: ...

    def tokenize(self, segments: list[Segment], refs: Sequence[ImageRef]) -> TokenizedExample: ...


def require_vision(images: Sequence[ImageRef], vision: ImageTokenizer | None) -> None:
    """``ChatDataError`` naming the first of ``images`` when the model takes no images."""
    if images and vision is None:
        raise ChatDataError(
            f"{images[0].path}",
            "the model takes text only: images need a vision-language base (docs/vision.md)",
        )


@dataclass(frozen=True)
class RowKind:
    """A file's format (``trainers.formats``) and, for the formats with two shapes, its shape: its first
    row's, required of every row."""

    format: FileFormat
    shape: Shape | None

    def __str__(self) -> str:
        return self.format.value if self.shape is None else self.shape.value


def first_row_kind(
    rows: Sequence[Any], accepted: frozenset[FileFormat], *, expected: str, param: str
) -> RowKind:
    """The kind of ``rows[0]``; ``DataError`` when there is no row or line 1 has none of ``accepted``."""
    if not rows:
        raise DataError("the file has no examples", param=param)
    fmt = detect(rows[0]) if isinstance(rows[0], Mapping) else None
    if fmt is None or fmt not in accepted:
        raise DataError(f"line 1: expected {expected}", param=param)
    return RowKind(fmt, shape(fmt, rows[0]))


def rows_of_kind(
    rows: Sequence[Any], kind: RowKind, *, param: str
) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """``(line, row)`` for each row (lines from 1); ``DataError`` on reaching a row not of ``kind``."""
    for line, row in enumerate(rows, start=1):
        fmt = detect(row, kind.format) if isinstance(row, Mapping) else None
        if fmt is not kind.format or shape(fmt, row) is not kind.shape:
            raise DataError(f"line {line}: every row must have the {kind} format of line 1", param=param)
        yield line, row


@contextmanager
def row_errors(line: int, kind: RowKind, *, param: str) -> Iterator[None]:
    """Re-raise what a malformed row raises (``DataError``, or the template's errors) as a ``DataError``
    naming the line."""
    try:
        yield
    except DataError as exc:
        raise DataError(f"line {line}: {exc.message}", param=param) from exc
    except (TypeError, KeyError, TemplateError) as exc:  # the template may reject e.g. the role order
        raise DataError(f"line {line}: malformed {kind} row ({exc})", param=param) from exc


def tokenize_sft_rows(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    param: str = "training_file",
    vision: ImageTokenizer | None = None,
) -> ExampleStore[TokenizedExample]:
    """Tokenize, mask, truncate and filter ``rows`` into an on-disk store (of ``vision``'s examples where
    the model takes images); raise ``DataError`` if nothing trainable remains."""
    examples = ExampleWriter(vision.example_type if vision is not None else TokenizedExample)
    n_truncated_away = 0
    for _, full in untruncated_examples(rows, tokenizer, param=param, vision=vision):
        example = truncated(full, max_length)
        if example.n_trainable > 0:
            examples.append(example)
        elif full.n_trainable > 0:
            n_truncated_away += 1
    if not examples:
        if n_truncated_away:
            raise DataError(
                f"every example was truncated away: max_length={max_length} leaves no trainable tokens",
                param="hyperparameters.max_length",
            )
        raise DataError(
            "no example has trainable tokens (e.g. no assistant message with weight 1)", param=param
        )
    return examples.finish()


def untruncated_examples(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    param: str = "training_file",
    vision: ImageTokenizer | None = None,
) -> Iterator[tuple[int, TokenizedExample]]:
    """``(line, example)`` of every row, tokenized and masked but not yet truncated (lines from 1); a
    conversation with images through ``vision`` (a text-only model: a ``DataError`` naming the image)."""
    kind = first_row_kind(
        rows, SFT_FORMATS, expected='{"messages": [...]}, {"prompt", "completion"} or {"text"}', param=param
    )
    bos, eos = _bos_text(tokenizer), _eos_text(tokenizer)
    for line, row in rows_of_kind(rows, kind, param=param):
        with row_errors(line, kind, param=param):
            sequences, chat = _sequences(row, kind.format, tokenizer, bos, eos, vision)
            refs = chat.images if chat is not None else []
            tokenized = [
                vision.tokenize(segments, refs) if vision is not None else _tokenize(segments, tokenizer)
                for segments in sequences
            ]
        yield from ((line, example) for example in tokenized)


def truncated(example: TokenizedExample, max_length: int) -> TokenizedExample:
    """What training keeps of ``example`` (``TokenizedExample.truncated``; with images, never a part of
    an image's segment: ``trainers.data.vision``)."""
    return example.truncated(max_length)


def _sequences(
    row: Mapping[str, Any],
    fmt: FileFormat,
    tokenizer: PreTrainedTokenizerBase,
    bos: str,
    eos: str,
    vision: ImageTokenizer | None,
) -> tuple[list[list[Segment]], Conversation | None]:
    """The row's training sequences as (text, trainable) segments: one, or for a chat whose template
    renders earlier turns differently once later ones follow, one per such turn; and the conversation
    when it has images (each sequence holds the first of them that its text has placeholders for)."""
    if fmt is FileFormat.CHAT:
        with read_errors():
            chat = read_chat(row["messages"], "messages", tools_from=row)
        require_vision(chat.images, vision)
        return training_sequences(tokenizer, chat), (chat if chat.images else None)
    if fmt is FileFormat.TEXT:
        return [[(bos, False), (_require_str(row["text"], "text") + eos, True)]], None
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, list) and isinstance(completion, list):
        with read_errors():
            context = read_chat(prompt, "prompt", tools_from=row)
            context.weights = [0] * len(context.weights)  # the prompt's turns carry no loss
            chat = continue_chat(context, completion, "completion")
        require_vision(chat.images, vision)
        return training_sequences(tokenizer, chat), (chat if chat.images else None)
    prompt = _require_str(prompt, "prompt")
    completion = _require_str(completion, "completion")
    return [[(bos + prompt, False), (completion + eos, True)]], None


def _tokenize(segments: list[Segment], tokenizer: PreTrainedTokenizerBase) -> TokenizedExample:
    ids: list[int] = []
    mask: list[bool] = []
    for text, trainable in segments:
        if not text:
            continue
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [trainable] * len(piece)
    if mask:
        mask[0] = False
    return TokenizedExample(ids, mask)


def _bos_text(tokenizer: PreTrainedTokenizerBase) -> str:
    """The BOS token's text if the tokenizer prepends BOS when encoding plain text (as Llama's do)."""
    bos_id = tokenizer.bos_token_id
    with_special = tokenizer("x")["input_ids"]
    without = tokenizer("x", add_special_tokens=False)["input_ids"]
    adds_bos = bos_id is not None and with_special[:1] == [bos_id] and without[:1] != [bos_id]
    return str(tokenizer.bos_token) if adds_bos else ""


def _eos_text(tokenizer: PreTrainedTokenizerBase) -> str:
    eos = tokenizer.eos_token
    return eos if isinstance(eos, str) else ""


def _require_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise DataError(f'"{name}" must be a string')
    return value
