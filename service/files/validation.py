"""Incremental validation of uploaded JSONL training files.

An upload is streamed to the blob store in chunks; every chunk is also fed to a :class:`JsonlValidator`,
which checks the file line by line without ever holding more than one partial line. The format of the file
is detected from its first example and every later example must have the same format (see "Data formats"
in DESIGN.md). Validation stops at the first problem with a :class:`FileValidationError` that names the
(1-based, physical) line and, where there is one, the offending field, e.g.::

    line 3: field 'messages[1].role': unknown role 'bot' (expected system, developer, user, assistant, tool)

Images (image parts of user and system messages, ``trainers.chat.images``) are checked as their line is:
``service.files.data_urls`` takes each base64 data URL out of the byte stream before a line is held, so a
line of images stays small, and ``service.files.images`` decodes and checks every image (an upload's
``UploadImages`` also keeps what is fetched, and the manifest). The rows themselves are read with the
torch-free ``trainers.chat``, ``trainers.registry`` and ``trainers.formats`` (the formats and the rule that
detects them are declared once, for this validator and the trainers), so it runs in the API process, a
worker or a CLI.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from service.files.data_urls import DataUrlSplitter
from service.files.images import UploadImages
from service.input_guard import unsafe_value
from trainers.chat.images import DEFAULT_LIMITS
from trainers.chat.pairs import preference_pair, prompt_and_completions, unpaired_example
from trainers.chat.rows import Conversation, ImageRef, RowProblem, json_type, read_chat, short
from trainers.formats import FileFormat, detect, shape
from trainers.registry import get_method

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "FileStats",
    "FileValidationError",
    "JsonlValidator",
    "method_formats",
    "validate_chunks",
]


def method_formats(method_type: str) -> frozenset[FileFormat]:
    """Which file formats a job method accepts for its training (and validation) file, as
    ``trainers.registry`` declares them (an unknown format name there fails here, and in its test)."""
    return frozenset(FileFormat(name) for name in get_method(method_type).formats)


_T = TypeVar("_T")
DEFAULT_MAX_LINE_BYTES = 4 * 1024 * 1024

_MAX_KEYS_SHOWN = 8


class FileValidationError(Exception):
    """A training file is invalid. ``str(error)`` is the full, user-facing message."""

    def __init__(self, message: str, *, line: int | None, field: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.field = field


@dataclass(frozen=True)
class FileStats:
    """The result of validating a whole file."""

    line_count: int
    """Number of examples (non-blank lines)."""
    format: FileFormat
    bytes: int
    """Total size of the file in bytes."""
    images: int = 0
    """Image parts of its rows."""
    image_examples: int = 0
    """Examples (lines) with at least one image."""


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


class _Line:
    """Validation of one example; raises :class:`FileValidationError` naming its line and field."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.images: list[ImageRef] = []  # the image parts of the rows read, in order

    def fail(self, field: str | None, message: str) -> NoReturn:
        prefix = f"line {self.number}: "
        if field is not None:
            prefix += f"field {field!r}: "
        raise FileValidationError(prefix + message, line=self.number, field=field)

    # -- primitives ---------------------------------------------------------------------------------------

    def require(self, obj: dict[str, Any], key: str, path: str) -> Any:
        if key not in obj:
            self.fail(path, "missing")
        return obj[key]

    def string(self, value: object, path: str, *, non_empty: bool = True) -> str:
        if not isinstance(value, str):
            self.fail(path, f"expected a string, got {json_type(value)}")
        if non_empty and not value.strip():
            self.fail(path, "must be a non-empty string")
        return value

    def obj(self, value: object, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(path, f"expected an object, got {json_type(value)}")
        return value

    def array(self, value: object, path: str) -> list[Any]:
        if not isinstance(value, list):
            self.fail(path, f"expected an array, got {json_type(value)}")
        if not value:
            self.fail(path, "must be a non-empty array")
        return value

    # -- chat rows (trainers.chat: the declaration the trainers read rows with too) -----------------------

    def read(self, read: Callable[[], _T]) -> _T:
        """``read()``, with a ``RowProblem`` (a malformed chat row) failing this line; the images of the
        conversations it returns are kept for their checks."""
        try:
            result = read()
        except RowProblem as exc:
            self.fail(exc.field, exc.message)
        self.images += _images_of(result)
        return result

    # -- formats ------------------------------------------------------------------------------------------

    def chat(self, example: dict[str, Any]) -> None:
        chat = self.read(lambda: read_chat(example["messages"], "messages", tools_from=example))
        assistants = [i for i, m in enumerate(chat.messages) if m["role"] == "assistant"]
        if not assistants:
            self.fail("messages", "no assistant message (a chat example needs at least one)")
        if not any(chat.weights[i] for i in assistants):
            self.fail("messages", "no assistant message with weight 1")

    def prompt_only(self, example: dict[str, Any]) -> None:
        if "messages" in example:
            chat = self.read(lambda: read_chat(example["messages"], "messages", tools_from=example))
            if chat.messages[-1]["role"] == "assistant":
                self.fail(
                    f"messages[{len(chat.messages) - 1}].role",
                    "the last message of a prompt must not be from the assistant",
                )
        else:
            self.string(example["prompt"], "prompt")

    def prompt_completion(self, example: dict[str, Any]) -> None:
        completion = self.require(example, "completion", "completion")
        read = self.read(
            lambda: prompt_and_completions(example["prompt"], {"completion": completion}, tools_from=example)
        )
        if read is None:
            self.string(example["prompt"], "prompt", non_empty=False)
            self.string(completion, "completion")

    def text(self, example: dict[str, Any]) -> None:
        self.string(example["text"], "text")

    def unpaired_preference(self, example: dict[str, Any]) -> None:
        label = self.require(example, "label", "label")
        if not isinstance(label, bool):
            self.fail("label", f"expected true or false, got {json_type(label)}")
        messages_shape = "messages" in example and "prompt" not in example
        read = self.read(lambda: unpaired_example(example, messages_shape=messages_shape))
        if read is None:
            self.string(example["prompt"], "prompt")
            self.string(example["completion"], "completion")

    def preference(self, example: dict[str, Any]) -> None:
        openai_shape = "preferred_output" in example or "non_preferred_output" in example
        if self.read(lambda: preference_pair(example, openai_shape=openai_shape)) is None:
            for key in ("prompt", "chosen", "rejected"):
                self.string(example[key], key)


def _images_of(read: object) -> list[ImageRef]:
    """The image parts of what a row reader returned: a conversation, or a prompt and its completions
    (each completion a copy of the prompt's conversation continued)."""
    if isinstance(read, Conversation):
        return list(read.images)
    if isinstance(read, tuple):
        prompt, completions = read
        return list(prompt.images) + [i for c in completions for i in c.images[len(prompt.images) :]]
    return []


def _classify(example: dict[str, Any], file_format: FileFormat | None, line: _Line) -> FileFormat:
    """The format of one example (``trainers.formats.detect``, the trainers' own rule); ``file_format``
    resolves shapes that two formats share."""
    detected = detect(example, file_format)
    if detected is not None:
        return detected
    keys = list(example)
    shown = ", ".join(short(k) for k in keys[:_MAX_KEYS_SHOWN])
    if len(keys) > _MAX_KEYS_SHOWN:
        shown += ", ..."
    line.fail(
        None,
        "cannot detect the example's format: expected 'messages', 'prompt' (and 'completion'), "
        "'text', 'input'/'preferred_output'/'non_preferred_output', 'prompt'/'chosen'/'rejected' or a "
        "boolean 'label' (with 'prompt'/'completion' or 'messages') "
        f"(found keys: {shown or 'none'})",
    )


def _shape(kind: FileFormat, example: dict[str, Any]) -> str:
    """Formats with two accepted shapes must use one of them for the whole file (the trainers read the
    file's shape from its first line)."""
    found = shape(kind, example)
    return kind.value if found is None else found.value


class JsonlValidator:
    """Validates a JSONL training file fed in arbitrary chunks.

    Holds at most one partial line (bounded by ``max_line_bytes``). The first error is raised from
    :meth:`feed` or :meth:`finish` and raised again by any later call.
    """

    def __init__(
        self,
        *,
        min_examples: int = 1,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        images: UploadImages | None = None,
    ) -> None:
        if min_examples < 1:
            raise ValueError("min_examples must be at least 1")
        if max_line_bytes < 1:
            raise ValueError("max_line_bytes must be at least 1")
        self.min_examples = min_examples
        self.max_line_bytes = max_line_bytes
        self._pending = bytearray()
        self._line_number = 0  # physical lines completed so far
        self._examples = 0
        self._bytes = 0
        self._format: FileFormat | None = None
        self._format_line = 0
        self._shape = ""
        self._error: FileValidationError | None = None
        self._stats: FileStats | None = None
        # the rows' images (the upload's store of them; by default checked, nothing kept or fetched)
        self.images = images if images is not None else UploadImages(DEFAULT_LIMITS)
        self._splitter = DataUrlSplitter(self.images.open_sink)

    @property
    def format(self) -> FileFormat | None:
        """The format detected so far (``None`` before the first example)."""
        return self._format

    @property
    def example_count(self) -> int:
        return self._examples

    def feed(self, chunk: bytes) -> None:
        """Validate the next chunk of the file. Raises :class:`FileValidationError`."""
        if self._error is not None:
            raise self._error
        if self._stats is not None:
            raise RuntimeError("feed() called after finish()")
        try:
            self._feed(chunk)
        except FileValidationError as exc:
            self._error = exc
            raise

    def finish(self) -> FileStats:
        """Validate the end of the file (a last line without newline included) and return its stats."""
        if self._error is not None:
            raise self._error
        if self._stats is not None:
            return self._stats
        try:
            self._feed(b"", final=True)
            if self._pending:
                line = bytes(self._pending)
                self._pending.clear()
                self._line_number += 1
                self._line(line)
            if self._format is None:
                raise FileValidationError("file is empty", line=None, field=None)
            if self._examples < self.min_examples:
                noun = "example" if self._examples == 1 else "examples"
                raise FileValidationError(
                    f"file has {self._examples} {noun}; at least {self.min_examples} are required",
                    line=None,
                    field=None,
                )
        except FileValidationError as exc:
            self._error = exc
            raise
        self._stats = FileStats(
            line_count=self._examples,
            format=self._format,
            bytes=self._bytes,
            images=self.images.images,
            image_examples=self.images.image_examples,
        )
        return self._stats

    # -- internals ----------------------------------------------------------------------------------------

    def _too_long(self, number: int) -> NoReturn:
        raise FileValidationError(
            f"line {number}: line is longer than {self.max_line_bytes} bytes", line=number, field=None
        )

    def _feed(self, chunk: bytes, *, final: bool = False) -> None:
        self._bytes += len(chunk)
        # the line as the validator reads it: each data URL taken out (service.files.data_urls)
        chunk = self._splitter.feed(chunk) + (self._splitter.flush() if final else b"")
        start = 0
        while (newline := chunk.find(b"\n", start)) != -1:
            self._line_number += 1
            if self._pending:
                if len(self._pending) + newline - start > self.max_line_bytes + 1:
                    self._too_long(self._line_number)
                self._pending += chunk[start:newline]
                line = bytes(self._pending)
                self._pending.clear()
            else:
                line = chunk[start:newline]
            self._line(line)
            start = newline + 1
        if start < len(chunk):
            self._pending += chunk[start:]
            # A complete line may be max_line_bytes long plus a "\r" before its "\n".
            size = len(self._pending)
            if size > self.max_line_bytes + 1 or (
                size == self.max_line_bytes + 1 and self._pending[-1:] != b"\r"
            ):
                self._too_long(self._line_number + 1)

    def _line(self, raw: bytes) -> None:
        number = self._line_number
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if len(raw) > self.max_line_bytes:
            self._too_long(number)
        line = _Line(number)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line.fail(None, f"invalid UTF-8 at byte {exc.start + 1} of the line ({exc.reason})")
        if number == 1 and text.startswith("\ufeff"):
            text = text[1:]  # tolerate a byte order mark
        if not text.strip():
            return
        try:
            example = json.loads(text, parse_constant=_reject_constant)
        except json.JSONDecodeError as exc:
            line.fail(None, f"invalid JSON: {exc.msg} (column {exc.colno})")
        except ValueError as exc:
            line.fail(None, f"invalid JSON: {exc}")
        except RecursionError:
            line.fail(None, "invalid JSON: nested too deeply")
        if not isinstance(example, dict):
            line.fail(None, f"expected a JSON object, got {json_type(example)}")
        # a lone surrogate ("\ud800": no tokenizer can encode it), 1e999 (infinity, as NaN above), a NUL:
        # refused here, naming the line, rather than failing the job later
        if found := unsafe_value(example):
            line.fail(found[0] or None, found[1])
        kind = _classify(example, self._format, line)
        if self._format is not None and kind is not self._format:
            line.fail(
                None,
                f"format {kind.value!r} differs from the file's format {self._format.value!r} "
                f"(detected at line {self._format_line})",
            )
        _VALIDATORS[kind](line, example)
        self.images.check(number, line.images, line.fail)
        shape = _shape(kind, example)
        if self._format is None:
            self._format = kind
            self._format_line = number
            self._shape = shape
        elif shape != self._shape:
            line.fail(
                None,
                f"shape {shape!r} differs from the file's shape {self._shape!r} (line {self._format_line}); "
                "use one shape per file",
            )
        self._examples += 1


_VALIDATORS = {
    FileFormat.CHAT: _Line.chat,
    FileFormat.PROMPT_COMPLETION: _Line.prompt_completion,
    FileFormat.TEXT: _Line.text,
    FileFormat.PREFERENCE: _Line.preference,
    FileFormat.PROMPT_ONLY: _Line.prompt_only,
    FileFormat.UNPAIRED_PREFERENCE: _Line.unpaired_preference,
}


def validate_chunks(
    chunks: Iterable[bytes], *, min_examples: int = 1, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
) -> FileStats:
    """Validate a whole file given as chunks (e.g. ``[data]`` or a file read in blocks)."""
    validator = JsonlValidator(min_examples=min_examples, max_line_bytes=max_line_bytes)
    for chunk in chunks:
        validator.feed(chunk)
    return validator.finish()
