"""Turn SFT rows into token ids plus a per-token loss mask.

Three row formats (``trainers.formats``: the rule the upload validator uses too), detected from the first
row and required of every row:

- chat ``{"messages": [...]}``: loss on assistant turns only; an assistant message with ``"weight": 0``
  gets no loss. The trainable spans are found by rendering the chat template incrementally (the prompt
  up to turn *i* with a generation prompt, then up to and including turn *i*), so any template whose
  renderings of successive prefixes extend one another works, with or without ``{% generation %}``.
- ``{"prompt", "completion"}``: loss on the completion (plus EOS) only. Message lists are accepted too
  and treated as a chat whose prompt turns carry no loss.
- ``{"text"}``: loss on every token (plus EOS), for continued pre-training.

Each segment is tokenized on its own, so a prompt is tokenized exactly as it is at inference time.
Examples are truncated to ``max_length``; those left with no trainable token are dropped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from trainers.core.errors import DataError
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


Segment = tuple[str, bool]  # (text, trainable)


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
) -> ExampleStore[TokenizedExample]:
    """Tokenize, mask, truncate and filter ``rows`` into an on-disk store; raise ``DataError`` if nothing
    trainable remains."""
    examples = ExampleWriter(TokenizedExample)
    n_truncated_away = 0
    for _, full in untruncated_examples(rows, tokenizer, param=param):
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
    rows: Sequence[Mapping[str, Any]], tokenizer: PreTrainedTokenizerBase, *, param: str = "training_file"
) -> Iterator[tuple[int, TokenizedExample]]:
    """``(line, example)`` of every row, tokenized and masked but not yet truncated (lines from 1)."""
    kind = first_row_kind(
        rows, SFT_FORMATS, expected='{"messages": [...]}, {"prompt", "completion"} or {"text"}', param=param
    )
    bos, eos = _bos_text(tokenizer), _eos_text(tokenizer)
    for line, row in rows_of_kind(rows, kind, param=param):
        with row_errors(line, kind, param=param):
            yield line, _tokenize(_segments(row, kind.format, tokenizer, bos, eos), tokenizer)


def truncated(example: TokenizedExample, max_length: int) -> TokenizedExample:
    """What training keeps of ``example``: its first ``max_length`` tokens (kept if one still trains)."""
    return TokenizedExample(example.input_ids[:max_length], example.loss_mask[:max_length])


def _segments(
    row: Mapping[str, Any], fmt: FileFormat, tokenizer: PreTrainedTokenizerBase, bos: str, eos: str
) -> list[Segment]:
    if fmt is FileFormat.CHAT:
        return chat_segments(row["messages"], tokenizer)
    if fmt is FileFormat.TEXT:
        return [(bos, False), (_require_str(row["text"], "text") + eos, True)]
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, list) and isinstance(completion, list):
        silent = [{**m, "weight": 0} if m.get("role") == "assistant" else m for m in prompt]
        return chat_segments([*silent, *completion], tokenizer)
    prompt = _require_str(prompt, "prompt")
    completion = _require_str(completion, "completion")
    return [(bos + prompt, False), (completion + eos, True)]


def chat_segments(messages: Any, tokenizer: PreTrainedTokenizerBase) -> list[Segment]:
    """Split the rendered conversation into (text, trainable) spans; assistant turns with weight 1 train."""
    if not isinstance(messages, list) or not messages:
        raise DataError('"messages" must be a non-empty list')
    plain: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise DataError(f"messages[{i}] must be an object")
        role = _require_str(message.get("role"), f"messages[{i}].role")
        content = _require_str(message.get("content"), f"messages[{i}].content")
        if message.get("weight", 1) not in (0, 1):
            raise DataError(f"messages[{i}].weight must be 0 or 1")
        plain.append({"role": role, "content": content})

    def render(msgs: list[dict[str, str]], generation_prompt: bool = False) -> str:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
        assert isinstance(text, str)
        return text

    full = render(plain)
    segments: list[Segment] = []
    done = 0  # characters of `full` already assigned to a segment
    for i, message in enumerate(messages):
        if plain[i]["role"] != "assistant":
            continue
        start, end = len(render(plain[:i], generation_prompt=True)), len(render(plain[: i + 1]))
        if not (done <= start <= end and full.startswith(render(plain[: i + 1]))):
            # A template that rewrites earlier turns (e.g. drops past reasoning) breaks prefix rendering.
            raise RuntimeError("the chat template does not render conversations incrementally")
        segments += [(full[done:start], False), (full[start:end], message.get("weight", 1) == 1)]
        done = end
    segments.append((full[done:], False))
    return segments


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
