"""How each model family's output is read back: the reply's content, its reasoning and its tool calls.

A chat template writes an assistant turn in its family's own markup; a model trained on it answers in the
same markup. A ``ChatFormat`` reads that markup back into what OpenAI's chat completions return
(``content``, ``reasoning_content``, ``tool_calls``), declared once per family and chosen by name or
detected from the template's text by the markers the format writes:

- ``hermes`` (Qwen2.5, Qwen3): ``<think>...</think>`` first, then content, then one
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block per call;
- ``llama3_json`` (Llama 3.1, 3.2): the whole turn is ``{"name": ..., "parameters": {...}}``, optionally
  after ``<|python_tag|>``; anything else is content;
- ``harmony`` (gpt-oss): messages on channels, ``<|channel|>analysis<|message|>...<|end|>`` the
  reasoning, ``<|channel|>final<|message|>...`` the content, and a message addressed
  ``to=functions.NAME`` (``...<|message|>{json}<|call|>``) a tool call;
- ``think`` (a template that writes ``<think>`` but no tool calls, e.g. DeepSeek-R1's distills): a leading
  ``<think>...</think>`` block is the reasoning, the rest the content;
- ``plain`` (Llama 3.0, Gemma, Phi, Mistral's templates here): everything is content.

Each format reads a finished output (``parse``) and a streamed one (``reader``: text pieces in as the
model writes them, ``Delta``s out), with one state machine, so the two never disagree. Text that may be
the start of a marker is held back until it is not; a tool call is handed out whole, once its closing
marker (or the end of the output) shows it is well formed. Markup that does not parse — bad JSON inside a
tool call, a call without a name — is left in the content as the model wrote it, never an error.

Standard library only: the API process and the graders import it; what needs a tokenizer (decoding with
the markers kept, rendering a prefill) lives in ``trainers.modeling.generation`` and ``trainers.data``.

>>> reply = HERMES.parse('<think>\\nAdd.\\n</think>\\n\\nSure.\\n<tool_call>\\n'
...                      '{"name": "add", "arguments": {"a": 1}}\\n</tool_call>')
>>> reply.reasoning_content, reply.content, reply.tool_calls
('Add.', 'Sure.', [ToolCall(name='add', arguments='{"a": 1}')])
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# gpt-oss's harmony markers
START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"


ToolChoice = Literal["none", "auto", "required", "function"]
"""OpenAI's ``tool_choice``, a named function being ``"function"`` (trainers/data/chat_prompt.py says what
each does to the prompt and to how the reply is read)."""


@dataclass(frozen=True)
class ToolCall:
    """One tool call read from the output: ``arguments`` is a JSON object's text, as OpenAI sends it."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Delta:
    """A piece of a streamed reply: content text, reasoning text, or one whole tool call."""

    content: str = ""
    reasoning: str = ""
    tool_call: ToolCall | None = None


@dataclass
class Reply:
    """A whole reply read back; ``reasoning_content`` is None where the output has none."""

    content: str = ""
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, delta: Delta) -> None:
        self.content += delta.content
        if delta.reasoning:
            self.reasoning_content = (self.reasoning_content or "") + delta.reasoning
        if delta.tool_call is not None:
            self.tool_calls.append(delta.tool_call)


def _first_marker(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else None


def _held_tail(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that a marker starts with (it may become one)."""
    for size in range(min(len(text), max((len(m) for m in markers), default=0) - 1), 0, -1):
        if any(m.startswith(text[-size:]) for m in markers):
            return size
    return 0


def _before(text: str, found: tuple[int, str] | None, markers: Sequence[str], *, final: bool) -> str:
    """The text before the marker ``found`` in ``text``; without one, all that cannot start a marker."""
    if found is not None:
        return text[: found[0]]
    return text if final else text[: len(text) - _held_tail(text, markers)]


def _arguments(value: Any) -> str | None:
    """A call's arguments as a JSON object's text, or None where they are not an object (or its text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _json_call(text: str, arguments_keys: Sequence[str]) -> ToolCall | None:
    """``{"name": ..., "<arguments key>": {...}}`` as a call; None where ``text`` is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return _named_call(obj, arguments_keys)


def _named_call(obj: Any, arguments_keys: Sequence[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = "{}" if key is None else _arguments(obj[key])
    return None if arguments is None else ToolCall(obj["name"], arguments)


class Reader:
    """Reads one output as it comes: ``feed`` each new piece of text, ``close`` at the end; each returns
    the deltas the text read so far makes certain. Subclasses implement ``_step``: consume what they can
    of ``self.pending`` and return whether to step again (``final``: no more text will come, hold
    nothing back)."""

    def __init__(self) -> None:
        self.pending = ""
        self._out: list[Delta] = []

    def feed(self, text: str) -> list[Delta]:
        self.pending += text
        while self._step(final=False):
            pass
        return self._take()

    def close(self) -> list[Delta]:
        while self._step(final=True):
            pass
        self.pending = ""
        return self._take()

    def _step(self, *, final: bool) -> bool:
        raise NotImplementedError

    def _take(self) -> list[Delta]:
        out, self._out = [d for d in self._out if d.content or d.reasoning or d.tool_call], []
        return out

    def _content(self, text: str) -> None:
        self._out.append(Delta(content=text))

    def _reasoning(self, text: str) -> None:
        self._out.append(Delta(reasoning=text))

    def _call(self, call: ToolCall) -> None:
        self._out.append(Delta(tool_call=call))


class _TagReader(Reader):
    """hermes, think and plain: an optional leading ``<think>`` block, content, and (``calls``)
    ``<tool_call>`` blocks. Newlines the templates write around the blocks are not content: those after
    ``<think>`` and before ``</think>``, after ``</think>``, the one before the first ``<tool_call>``,
    and the whitespace between and after the calls."""

    def __init__(self, *, think: bool, calls: bool, reasoning_open: bool) -> None:
        super().__init__()
        self.think, self.calls = think, calls
        self.state = "reasoning" if reasoning_open else "start" if think else "content"
        self.trim = reasoning_open  # leading newlines to drop in the next state's text

    def _step(self, *, final: bool) -> bool:
        if self.state == "start":
            head = self.pending.lstrip()
            if head.startswith(THINK_OPEN):
                self.pending, self.state, self.trim = head[len(THINK_OPEN) :], "reasoning", True
                return True
            if THINK_OPEN.startswith(head) and not final:
                return False  # whitespace, or the start of <think>: wait
            self.state = "content"
            return True
        if self.state == "reasoning":
            return self._text(THINK_CLOSE, self._reasoning, "content", final=final, strip_before="\n")
        if self.state == "content":
            if not self.calls:
                return self._text(None, self._content, "content", final=final, strip_before="")
            return self._text(TOOL_OPEN, self._content, "call", final=final, strip_before="\n", once=True)
        if self.state == "call":
            found = _first_marker(self.pending, (TOOL_CLOSE,))
            if found is None and not final:
                return False
            body = self.pending if found is None else self.pending[: found[0]]
            call = _json_call(body.strip(), ("arguments", "parameters"))
            if call is not None:
                self._call(call)
            else:  # left as the model wrote it
                self._content(TOOL_OPEN + body + ("" if found is None else TOOL_CLOSE))
            self.pending = "" if found is None else self.pending[found[0] + len(TOOL_CLOSE) :]
            self.state = "after_call"
            return found is not None
        # after a call: whitespace until the next call or the end is the template's, anything else content
        found = _first_marker(self.pending, (TOOL_OPEN,))
        before = _before(self.pending, found, (TOOL_OPEN,), final=final)
        if before.strip():
            self.state = "content"
            return True
        if found is not None:
            self.pending, self.state = self.pending[found[0] + len(TOOL_OPEN) :], "call"
            return True
        if final:
            self.pending = ""
        return False

    def _text(
        self,
        marker: str | None,
        emit: Callable[[str], None],
        then: str,
        *,
        final: bool,
        strip_before: str,
        once: bool = False,
    ) -> bool:
        """Hand out the text up to ``marker`` through ``emit`` and go to state ``then`` past it; without
        the marker yet, hand out what cannot be part of it, nor the trailing ``strip_before`` characters
        that go if it follows (all of them, or ``once``: one)."""
        if self.trim:
            self.pending = self.pending.lstrip("\n")
            if not self.pending and not final:
                return False
            self.trim = False
        found = None if marker is None else _first_marker(self.pending, (marker,))
        if found is not None:
            before = self.pending[: found[0]]
            if strip_before and before.endswith(strip_before):
                before = before[: -len(strip_before)] if once else before.rstrip(strip_before)
            emit(before)
            self.pending, self.state = self.pending[found[0] + len(marker or "") :], then
            self.trim = then == "content"  # the template's newlines after </think>
            return True
        if final:
            text = self.pending
            if self.state == "reasoning":
                text = text.rstrip("\n")
            emit(text)
            self.pending = ""
            return False
        held = _held_tail(self.pending, (marker,)) if marker else 0
        safe = self.pending[: len(self.pending) - held]
        if strip_before:
            kept = safe.rstrip(strip_before)
            safe = kept if not once or len(safe) - len(kept) <= 1 else safe[:-1]
        emit(safe)
        self.pending = self.pending[len(safe) :]
        return False


class _Llama3JsonReader(Reader):
    """llama3_json: an output that starts with ``{`` or ``<|python_tag|>`` is held to the end and read
    as calls (JSON objects with ``name`` and ``parameters``, one or several separated by ``;``); anything
    else streams as content."""

    def __init__(self, *, calls: bool) -> None:
        super().__init__()
        self.state = "start" if calls else "content"

    def _step(self, *, final: bool) -> bool:
        if self.state == "content":
            self._content(self.pending)
            self.pending = ""
            return False
        head = self.pending.lstrip()
        if self.state == "start":
            if head.startswith((PYTHON_TAG, "{")):
                self.state = "calls"
            elif PYTHON_TAG.startswith(head) and not final:
                return False
            else:
                self.state = "content"
            return True
        if not final:
            return False
        calls = _json_calls(head.removeprefix(PYTHON_TAG).strip())
        if calls:
            for call in calls:
                self._call(call)
        else:
            self._content(self.pending)
        self.pending = ""
        return False


def _json_calls(text: str) -> list[ToolCall] | None:
    """Calls written as JSON objects one after another (``;`` or whitespace between), or None."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            obj, end = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _named_call(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        at = end
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
    return calls or None


_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


class _HarmonyReader(Reader):
    """harmony: messages ``[<|start|>assistant]<header><|message|><body><|end|>|<|call|>|<|return|>``, the
    first one's ``<|start|>assistant`` being the generation prompt's. The header names the channel
    (``<|channel|>analysis``) and a recipient (``to=functions.NAME``); its body is reasoning (analysis),
    a tool call (to a function), or content (final, or commentary to nobody). An output that does not
    start with a header is content as it is."""

    BODY_ENDS = (END, CALL, RETURN)

    def __init__(self, *, calls: bool) -> None:
        super().__init__()
        self.state = "start"
        self.header = ""
        self.calls = calls

    def _step(self, *, final: bool) -> bool:
        if self.state == "start":
            head = self.pending.lstrip()
            opens = (CHANNEL, "to=", START)
            if head.startswith(opens):
                self.state = "header"
            elif any(o.startswith(head) for o in opens) and not final:
                return False
            else:
                self.state = "raw"
            return True
        if self.state == "raw":
            self._content(self.pending)
            self.pending = ""
            return False
        if self.state == "between":
            found = _first_marker(self.pending, (START,))
            before = _before(self.pending, found, (START,), final=final)
            if before.strip():  # text outside any message: shown as it is
                self.state = "raw"
                return True
            if found is None:
                if final:
                    self.pending = ""
                return False
            self.pending, self.state = self.pending[found[0] :], "header"
            return True
        if self.state == "header":
            found = _first_marker(self.pending, (MESSAGE,))
            if found is None:
                if final:
                    self._content(self.pending)
                    self.pending = ""
                return False
            self.header = self.pending[: found[0]]
            self.pending = self.pending[found[0] + len(MESSAGE) :]
            self.state = "body"
            return True
        # body
        recipient = _RECIPIENT.search(self.header)
        channel = _CHANNEL.search(self.header)
        found = _first_marker(self.pending, self.BODY_ENDS)
        if recipient is not None and self.calls:  # a call: read whole
            if found is None and not final:
                return False
            body = self.pending if found is None else self.pending[: found[0]]
            name = recipient.group(1)
            arguments = _arguments(body.strip()) if name.startswith("functions.") else None
            if arguments is not None and len(name) > len("functions."):
                self._call(ToolCall(name.removeprefix("functions."), arguments))
            else:
                end = "" if found is None else found[1]
                self._content(self.header + MESSAGE + body + end)
        else:
            emit = (
                self._reasoning if channel is not None and channel.group(1) == "analysis" else self._content
            )
            if found is None:
                held = 0 if final else _held_tail(self.pending, self.BODY_ENDS)
                emit(self.pending[: len(self.pending) - held])
                self.pending = self.pending[len(self.pending) - held :]
                return False
            emit(self.pending[: found[0]])
        self.pending = "" if found is None else self.pending[found[0] + len(found[1]) :]
        self.state = "between"
        return found is not None


@dataclass(frozen=True)
class ChatFormat:
    """One family's output markup (the module's docstring): what it reads, and the markers a decoder must
    keep for it (special tokens that ``skip_special_tokens`` would drop)."""

    name: str
    families: str
    tool_calls: bool  # whether it reads tool calls
    reasoning: bool  # whether it reads reasoning
    markers: tuple[str, ...]
    new_reader: Callable[[bool, bool], Reader] = field(repr=False)  # (reasoning open, read tool calls)
    reasoning_open: str | None = None  # a generation prompt ending with it starts inside the reasoning

    def reader(self, prompt: str = "", *, tool_calls: bool = True) -> Reader:
        """A reader of one output of the model for ``prompt`` (the rendered prompt: one whose generation
        prompt opens the reasoning block, as DeepSeek-R1's does, starts the output inside it).
        ``tool_calls`` False: calls are content as written (a reply that may call no tool)."""
        opened = self.reasoning_open is not None and prompt.rstrip().endswith(self.reasoning_open)
        return self.new_reader(opened, tool_calls)

    def parse(self, text: str, prompt: str = "", *, tool_calls: bool = True) -> Reply:
        reader, reply = self.reader(prompt, tool_calls=tool_calls), Reply()
        for delta in [*reader.feed(text), *reader.close()]:
            reply.add(delta)
        return reply


HERMES = ChatFormat(
    "hermes",
    "Qwen2.5, Qwen3",
    tool_calls=True,
    reasoning=True,
    markers=(THINK_OPEN, THINK_CLOSE, TOOL_OPEN, TOOL_CLOSE),
    new_reader=lambda opened, calls: _TagReader(think=True, calls=calls, reasoning_open=opened),
    reasoning_open=THINK_OPEN,
)
LLAMA3_JSON = ChatFormat(
    "llama3_json",
    "Llama 3.1, Llama 3.2",
    tool_calls=True,
    reasoning=False,
    markers=(PYTHON_TAG,),
    new_reader=lambda opened, calls: _Llama3JsonReader(calls=calls),
)
HARMONY = ChatFormat(
    "harmony",
    "gpt-oss",
    tool_calls=True,
    reasoning=True,
    markers=(START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN),
    new_reader=lambda opened, calls: _HarmonyReader(calls=calls),
)
THINK = ChatFormat(
    "think",
    "DeepSeek-R1 distills, any template writing <think> without tool calls",
    tool_calls=False,
    reasoning=True,
    markers=(THINK_OPEN, THINK_CLOSE),
    new_reader=lambda opened, calls: _TagReader(think=True, calls=False, reasoning_open=opened),
    reasoning_open=THINK_OPEN,
)
PLAIN = ChatFormat(
    "plain",
    "Llama 3.0, Gemma, Phi, Mistral and any other template",
    tool_calls=False,
    reasoning=False,
    markers=(),
    new_reader=lambda opened, calls: _TagReader(think=False, calls=False, reasoning_open=False),
)

FORMATS: dict[str, ChatFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, HARMONY, THINK, PLAIN)}


def detect_format(template: str | None) -> ChatFormat:
    """The format a chat template's text writes, by its markers (a template that writes none of them,
    or no template: ``plain``).

    >>> detect_format("{{- '<tool_call>\\\\n{\\"name\\": \\"' }}").name, detect_format(None).name
    ('hermes', 'plain')
    """
    text = template or ""
    if CHANNEL in text and CALL in text:
        return HARMONY
    if TOOL_OPEN in text:
        return HERMES
    if "<|start_header_id|>" in text and '"parameters"' in text:
        return LLAMA3_JSON
    if THINK_CLOSE in text:
        return THINK
    return PLAIN
