"""OpenAI's chat row, declared once, and read into the messages every chat template reads.

A chat row — SFT's ``{"messages"}``, a preference pair's ``input`` and outputs, a KTO row, an RL prompt,
a ``/v1/chat/completions`` request — is OpenAI's fine-tuning format:

- ``messages``: ``system``, ``developer``, ``user``, ``assistant`` and ``tool`` messages (and the legacy
  ``function`` role); ``content`` a string or a list of text parts, and in a user or system message image
  parts too (``trainers.chat.images``: OpenAI's vision rows); an assistant's ``tool_calls`` (its
  content then may be null or empty), legacy ``function_call``, ``weight`` (0 or 1) and reasoning
  (``reasoning_content``, ``reasoning`` or ``thinking``, or a leading ``<think>...</think>`` in its
  content); a tool message's ``tool_call_id``; any message's ``name``;
- ``tools`` (or the legacy ``functions``) and ``parallel_tool_calls`` beside the messages.

``read_chat`` checks one and returns a ``Conversation`` in the form Hugging Face chat templates read:

- ``developer`` becomes ``system`` (OpenAI treats them alike; templates without a developer role drop or
  refuse it), ``function`` becomes ``tool``, ``functions`` become ``tools`` and ``function_call`` a
  one-call ``tool_calls``;
- text parts are joined into one string; a message with images keeps its parts in order, each image as
  ``{"type": "image"}`` (what the vision families' templates turn into their image placeholder) and its
  URL and ``detail`` in ``Conversation.images``, in the order the template meets them; a tool call's
  ``arguments`` (a JSON string in OpenAI's format)
  become an object, as templates serialise them (``tojson``); a call without an ``id`` gets one;
- reasoning is given under all three names templates read (Qwen3 ``reasoning_content``, gpt-oss
  ``thinking``, others ``reasoning``), and keys a message does not have are left out, since templates
  test for their presence (gpt-oss and Llama 3.1 read ``"tool_calls" in message``).

A problem raises ``RowProblem`` naming the field (``messages[2].tool_calls[0].function.arguments``); the
upload validator adds the line, the trainers raise it as a data error. Standard library only: the API
process reads rows with it.

>>> chat = read_chat([{"role": "user", "content": "Hi"},
...                   {"role": "assistant", "content": None, "tool_calls": [
...                       {"id": "c1", "type": "function",
...                        "function": {"name": "wave", "arguments": '{"times": 2}'}}]}], "messages")
>>> chat.messages[1]["content"], chat.messages[1]["tool_calls"][0]["function"]
('', {'name': 'wave', 'arguments': {'times': 2}})
>>> chat.weights
[0, 1]
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from trainers.chat.images import DETAILS, IMAGE_PART_TYPE, IMAGE_ROLES, parse_data_url, url_kind

Message = dict[str, Any]

ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool", "function")
"""The roles a row's message may have (``function``: OpenAI's legacy tool result)."""
REASONING_KEYS: tuple[str, ...] = ("reasoning_content", "reasoning", "thinking")
"""The fields an assistant message's reasoning may come in; all three are handed to the template."""
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""OpenAI's rule for a function's name."""
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Field:
    """One field of a chat row, as docs/data-formats.md lists it (``trainers.method_docs`` renders it)."""

    where: str  # "row", "message", "assistant message", "tool message"
    name: str
    accepts: str
    meaning: str


FIELDS: tuple[Field, ...] = (
    Field("row", "messages", "array of messages", "the conversation"),
    Field(
        "row",
        "tools",
        '`[{"type": "function", "function": {"name", "description", "parameters", "strict"}}]`',
        "the functions the model may call; the template writes their schemas into the prompt (not trained)",
    ),
    Field("row", "functions", '`[{"name", "description", "parameters"}]`', "legacy: read as `tools`"),
    Field(
        "row",
        "parallel_tool_calls",
        "`true` \\| `false`",
        "`false`: an assistant message makes at most one call",
    ),
    Field(
        "message",
        "role",
        ", ".join(f"`{r}`" for r in ROLES),
        "`developer` is read as `system` (OpenAI treats them alike); `function` (legacy) as `tool`",
    ),
    Field(
        "message",
        "content",
        'string, or `[{"type": "text", "text"}]`',
        "text parts are joined; null or empty on an assistant message that calls tools",
    ),
    Field(
        "content part of a user or system message",
        "image_url",
        '`{"type": "image_url", "image_url": {"url", "detail"}}`',
        "an image, for vision bases ([vision.md](vision.md)): `url` a base64 `data:` URL or an `http(s)` "
        "URL fetched once at upload; `detail` `low`, `high` or `auto` (default)",
    ),
    Field("message", "name", "string", "handed to the template as it is"),
    Field(
        "assistant message",
        "tool_calls",
        '`[{"id", "type": "function", "function": {"name", "arguments"}}]`',
        "trained; `arguments` a JSON object, as a string (OpenAI's) or an object; a missing `id` is made",
    ),
    Field("assistant message", "function_call", '`{"name", "arguments"}`', "legacy: read as one tool call"),
    Field(
        "assistant message",
        " / ".join(REASONING_KEYS),
        "string",
        "the turn's reasoning, trained where the family's template writes it; or a leading "
        "`<think>...</think>` in `content`",
    ),
    Field("assistant message", "weight", "`0` \\| `1`", "`0`: context only, not trained (default `1`)"),
    Field(
        "tool message",
        "tool_call_id",
        "string",
        "the call it answers (default: the first call without a result); a `function` message answers "
        "the latest call of its `name`",
    ),
)

_SHOWN = 40


class RowProblem(ValueError):
    """A chat row that cannot be read: ``field`` is the path of what is wrong (None: the row)."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(f"field {field!r}: {message}" if field else message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ImageRef:
    """An image of a conversation: its URL (``data:`` or ``http(s)``), OpenAI's ``detail`` and where the
    part was in the row (``messages[1].content[0]``)."""

    url: str
    detail: str
    path: str


@dataclass
class Conversation:
    """A chat row read (the module's docstring says into what). ``weights[i]`` is 1 for an assistant
    message that trains and 0 for every other message."""

    messages: list[Message]
    weights: list[int]
    paths: list[str]  # where each message was in the row, for errors: "messages[2]", "preferred_output[0]"
    tools: list[dict[str, Any]] | None = None
    parallel_tool_calls: bool | None = None
    tools_field: str = "tools"  # where the tools were in the row ("input.tools", "functions"), for errors
    images: list[ImageRef] = field(default_factory=list)  # in the order of the messages and their parts
    # the tool calls made so far that no tool message answered yet, in order: (id, name)
    open_calls: list[tuple[str, str]] = field(default_factory=list, repr=False)
    call_names: dict[str, str] = field(default_factory=dict, repr=False)  # every call's id -> name

    def template_kwargs(self) -> dict[str, Any]:
        """What ``apply_chat_template`` takes besides the messages."""
        return {"tools": self.tools} if self.tools else {}


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _fail(path: str | None, message: str) -> NoReturn:
    raise RowProblem(path, message)


def _present(obj: Mapping[str, Any], key: str, path: str) -> Any:
    """``obj[key]``; ``RowProblem`` naming ``path`` when the key is absent."""
    if key not in obj:
        _fail(path, "missing")
    return obj[key]


def _string(value: object, path: str, *, non_empty: bool = True) -> str:
    if not isinstance(value, str):
        _fail(path, f"expected a string, got {json_type(value)}")
    if non_empty and not value.strip():
        _fail(path, "must be a non-empty string")
    return value


def _object(value: object, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        _fail(path, f"expected an object, got {json_type(value)}")
    return value


def _array(value: object, path: str) -> list[Any]:
    if not isinstance(value, list):
        _fail(path, f"expected an array, got {json_type(value)}")
    if not value:
        _fail(path, "must be a non-empty array")
    return value


# -- tools ---------------------------------------------------------------------------------------------


def read_tools(
    source: Mapping[str, Any], prefix: str = ""
) -> tuple[list[dict[str, Any]] | None, bool | None]:
    """The ``tools`` (or legacy ``functions``) and ``parallel_tool_calls`` of ``source`` (a row, or a
    preference row's ``input``), as templates read tools: ``{"type": "function", "function": {...}}``."""
    if "tools" in source and "functions" in source and source["tools"] and source["functions"]:
        _fail(f"{prefix}functions", "give either tools or the legacy functions, not both")
    tools: list[dict[str, Any]] | None = None
    if source.get("tools") is not None:
        raw = source["tools"]
        if not isinstance(raw, list):
            _fail(f"{prefix}tools", f"expected an array, got {json_type(raw)}")
        tools = [_tool(item, f"{prefix}tools[{i}]") for i, item in enumerate(raw)]
    elif source.get("functions") is not None:
        raw = source["functions"]
        if not isinstance(raw, list):
            _fail(f"{prefix}functions", f"expected an array, got {json_type(raw)}")
        tools = [
            {"type": "function", "function": _function(item, f"{prefix}functions[{i}]")}
            for i, item in enumerate(raw)
        ]
    if tools is not None:
        seen: set[str] = set()
        for i, tool in enumerate(tools):
            name = tool["function"]["name"]
            if name in seen:
                key = "tools" if source.get("tools") is not None else "functions"
                _fail(f"{prefix}{key}[{i}]", f"a second function named {name!r}")
            seen.add(name)
    parallel = source.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        _fail(f"{prefix}parallel_tool_calls", f"expected true or false, got {json_type(parallel)}")
    return (tools or None), parallel


def _tool(raw: object, path: str) -> dict[str, Any]:
    tool = _object(raw, path)
    kind = tool.get("type", "function")
    if kind != "function":
        _fail(f"{path}.type", f"unsupported tool type {short(kind)} (expected 'function')")
    function = _function(tool.get("function"), f"{path}.function")
    return {"type": "function", "function": function}


def _function(raw: object, path: str) -> dict[str, Any]:
    function = _object(raw, path)
    name = _string(function.get("name"), f"{path}.name")
    if not TOOL_NAME.match(name):
        _fail(f"{path}.name", f"{short(name)} must be 1-64 letters, digits, '_' or '-'")
    out: dict[str, Any] = {"name": name}
    if function.get("description") is not None:
        out["description"] = _string(function["description"], f"{path}.description", non_empty=False)
    if function.get("parameters") is not None:
        out["parameters"] = _object(function["parameters"], f"{path}.parameters")
    if function.get("strict") is not None:
        if not isinstance(function["strict"], bool):
            _fail(f"{path}.strict", f"expected true or false, got {json_type(function['strict'])}")
        out["strict"] = function["strict"]
    return out


# -- messages ------------------------------------------------------------------------------------------


def text_content(value: object, path: str, *, non_empty: bool = True, images_allowed: bool = False) -> str:
    """A message's content as one string: a string, or the text parts of a list joined
    (``images_allowed``: a user or system message's, whose refusal names image parts too)."""
    if isinstance(value, str):
        return _string(value, path, non_empty=non_empty)
    if not isinstance(value, list):
        _fail(path, f"expected a non-empty string or a list of text parts, got {json_type(value)}")
    if not value:
        _fail(path, "must be a non-empty string or a non-empty list of text parts")
    texts = []
    for i, raw in enumerate(value):
        part = _object(raw, f"{path}[{i}]")
        kind = _present(part, "type", f"{path}[{i}].type")
        if kind == IMAGE_PART_TYPE:
            _fail(f"{path}[{i}]", "images are allowed in user and system messages only (OpenAI's rule)")
        if kind != "text":
            expected = f"'text' or '{IMAGE_PART_TYPE}'" if images_allowed else "'text'"
            _fail(f"{path}[{i}].type", f"unsupported content part type {short(kind)} (expected {expected})")
        texts.append(_string(_present(part, "text", f"{path}[{i}].text"), f"{path}[{i}].text"))
    return "".join(texts)


def image_part(raw: Mapping[str, Any], path: str) -> ImageRef:
    """An image content part (``{"type": "image_url", "image_url": {"url", "detail"}}`` at ``path``)."""
    image = _object(_present(raw, "image_url", f"{path}.image_url"), f"{path}.image_url")
    url = _string(_present(image, "url", f"{path}.image_url.url"), f"{path}.image_url.url")
    kind = url_kind(url)
    if kind is None:
        _fail(f"{path}.image_url.url", "expected a data: URL (base64) or an http(s) URL")
    if kind == "data":
        try:
            parse_data_url(url)
        except ValueError as exc:
            _fail(f"{path}.image_url.url", str(exc))
    detail = image.get("detail", "auto")
    if detail not in DETAILS:
        _fail(f"{path}.image_url.detail", f"expected one of {', '.join(DETAILS)}, got {short(detail)}")
    return ImageRef(url, detail, path)


def _content_with_images(value: object, path: str, images: list[ImageRef]) -> str | list[dict[str, str]]:
    """A user or system message's content: its text as one string when it has no image part, else its
    parts in order (adjacent text parts joined), each image appended to ``images``."""
    if not isinstance(value, list) or not any(
        isinstance(p, dict) and p.get("type") == IMAGE_PART_TYPE for p in value
    ):
        return text_content(value, path, images_allowed=True)
    parts: list[dict[str, str]] = []
    for i, raw in enumerate(value):
        part = _object(raw, f"{path}[{i}]")
        kind = _present(part, "type", f"{path}[{i}].type")
        if kind == IMAGE_PART_TYPE:
            images.append(image_part(part, f"{path}[{i}]"))
            parts.append({"type": "image"})
        elif kind == "text":
            text = _string(_present(part, "text", f"{path}[{i}].text"), f"{path}[{i}].text", non_empty=False)
            if parts and parts[-1]["type"] == "text":
                parts[-1] = {"type": "text", "text": parts[-1]["text"] + text}
            elif text:
                parts.append({"type": "text", "text": text})
        else:
            _fail(
                f"{path}[{i}].type",
                f"unsupported content part type {short(kind)} (expected 'text' or '{IMAGE_PART_TYPE}')",
            )
    return parts


def message_text(content: str | list[dict[str, str]]) -> str:
    """A read message's text: its content string, or its text parts joined (its images left out)."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if p["type"] == "text")


def check_image_count(chat: Conversation, limit: int) -> None:
    """``RowProblem`` naming the first image past ``limit`` images in one example."""
    if len(chat.images) > limit:
        _fail(chat.images[limit].path, f"more than {limit} images in one example")


def _arguments(value: object, path: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        _fail(path, f"expected a string or an object, got {json_type(value)}")
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        _fail(path, f"not valid JSON ({exc})")
    if not isinstance(parsed, dict):
        _fail(path, f"must be a JSON object, got {json_type(parsed)}")
    return parsed


def _reasoning(message: Mapping[str, Any], path: str, content: str) -> tuple[str | None, str]:
    """The assistant message's reasoning (None: none) and its content without a leading think block."""
    given = [(key, message[key]) for key in REASONING_KEYS if message.get(key) is not None]
    texts = {key: _string(value, f"{path}.{key}", non_empty=False) for key, value in given}
    if len(set(texts.values())) > 1:
        _fail(f"{path}.{given[1][0]}", f"differs from {given[0][0]}: give the reasoning once")
    reasoning = next(iter(texts.values()), None)
    stripped = content.lstrip()
    if stripped.startswith(THINK_OPEN) and THINK_CLOSE in stripped:
        if reasoning is not None:
            _fail(f"{path}.content", f"holds a {THINK_OPEN} block and the message has {given[0][0]} too")
        inner, _, rest = stripped[len(THINK_OPEN) :].partition(THINK_CLOSE)
        return inner.strip("\n"), rest.lstrip("\n")
    return (reasoning if reasoning else None), content


class _Reader:
    """Reads one conversation's messages in order, keeping which tool calls await their results."""

    def __init__(self, conversation: Conversation) -> None:
        self.chat = conversation
        self.tool_names = {t["function"]["name"] for t in conversation.tools or ()}

    def add(self, raw: object, path: str, *, only_assistant: bool = False) -> None:
        message = _object(raw, path)
        role = message.get("role")
        if "role" not in message:
            _fail(f"{path}.role", "missing")
        if not isinstance(role, str):
            _fail(f"{path}.role", f"expected a string, got {json_type(role)}")
        if role not in ROLES:
            _fail(f"{path}.role", f"unknown role {short(role)} (expected {', '.join(ROLES)})")
        if only_assistant and role != "assistant":
            _fail(f"{path}.role", f"expected 'assistant', got {short(role)}")
        if "weight" in message and role != "assistant":
            _fail(f"{path}.weight", "only an assistant message has a weight")
        for key in REASONING_KEYS:
            if message.get(key) is not None and role != "assistant":
                _fail(f"{path}.{key}", "only an assistant message has reasoning")
        for key in ("tool_calls", "function_call"):
            if message.get(key) is not None and role != "assistant":
                _fail(f"{path}.{key}", f"only assistant messages may have {key}")
        if role == "assistant":
            out, weight = self._assistant(message, path)
        elif role in ("tool", "function"):
            out, weight = self._tool_result(message, path, role), 0
        else:
            assert role in IMAGE_ROLES
            out = {"role": "system" if role == "developer" else role}
            content = _present(message, "content", f"{path}.content")
            out["content"] = _content_with_images(content, f"{path}.content", self.chat.images)
            weight = 0
        name = message.get("name")
        if name is not None and "name" not in out:
            out["name"] = _string(name, f"{path}.name")
        self.chat.messages.append(out)
        self.chat.weights.append(weight)
        self.chat.paths.append(path)

    def _assistant(self, message: Mapping[str, Any], path: str) -> tuple[Message, int]:
        calls = self._calls(message, path)
        content_value = message.get("content")
        if calls and content_value in (None, ""):
            content = ""
        elif "content" not in message or content_value is None:
            _fail(f"{path}.content", "missing (an assistant message needs content or tool_calls)")
        else:
            content = text_content(content_value, f"{path}.content")
        reasoning, content = _reasoning(message, path, content)
        out: Message = {"role": "assistant", "content": content}
        if calls:
            out["tool_calls"] = calls
        if reasoning is not None:
            out.update(dict.fromkeys(REASONING_KEYS, reasoning))
        weight = message.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight not in (0, 1):
            _fail(f"{path}.weight", f"must be 0 or 1, got {short(weight)}")
        return out, int(weight)

    def _calls(self, message: Mapping[str, Any], path: str) -> list[dict[str, Any]]:
        legacy = message.get("function_call")
        if message.get("tool_calls") is not None and legacy is not None:
            _fail(f"{path}.function_call", "give either tool_calls or the legacy function_call, not both")
        if legacy is not None:
            function = _object(legacy, f"{path}.function_call")
            raw_calls: list[Any] = [{"type": "function", "function": function}]
            call_path = f"{path}.function_call"
            paths = [call_path]
            function_paths = [call_path]
        elif message.get("tool_calls") is not None:
            raw_calls = _array(message["tool_calls"], f"{path}.tool_calls")
            paths = [f"{path}.tool_calls[{i}]" for i in range(len(raw_calls))]
            function_paths = [f"{p}.function" for p in paths]
        else:
            return []
        if len(raw_calls) > 1 and self.chat.parallel_tool_calls is False:
            _fail(f"{path}.tool_calls", "several calls in one message, but parallel_tool_calls is false")
        index = len(self.chat.messages)
        calls = []
        for j, (raw, call_path, function_path) in enumerate(
            zip(raw_calls, paths, function_paths, strict=True)
        ):
            call = _object(raw, call_path)
            if call.get("type", "function") != "function":
                _fail(
                    f"{call_path}.type",
                    f"unsupported tool call type {short(call['type'])} (expected 'function')",
                )
            function = _object(_present(call, "function", function_path), function_path)
            name = _string(_present(function, "name", f"{function_path}.name"), f"{function_path}.name")
            if self.tool_names and name not in self.tool_names:
                known = ", ".join(sorted(self.tool_names))
                _fail(f"{function_path}.name", f"{short(name)} is not one of the row's tools ({known})")
            arguments = _arguments(function.get("arguments", {}), f"{function_path}.arguments")
            given_id = call.get("id")
            call_id = f"call_{index}_{j}" if given_id is None else _string(given_id, f"{call_path}.id")
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            )
            self.chat.open_calls.append((call_id, name))
            self.chat.call_names[call_id] = name
        return calls

    def _tool_result(self, message: Mapping[str, Any], path: str, role: str) -> Message:
        content = text_content(_present(message, "content", f"{path}.content"), f"{path}.content")
        if not self.chat.call_names:
            _fail(f"{path}.role", f"a {role} message needs an earlier assistant message that calls a tool")
        call_id = message.get("tool_call_id")
        if role == "function":  # legacy: answers the latest open call of its name
            name = _string(message.get("name"), f"{path}.name")
            open_ids = [i for i, n in self.chat.open_calls if n == name]
            if not open_ids:
                _fail(f"{path}.name", f"no earlier function_call of {short(name)} awaits a result")
            call_id = open_ids[-1]
        elif call_id is not None:
            call_id = _string(call_id, f"{path}.tool_call_id")
            if call_id not in self.chat.call_names:
                _fail(f"{path}.tool_call_id", f"no earlier tool call has the id {short(call_id)}")
        elif self.chat.open_calls:
            call_id = self.chat.open_calls[0][0]  # the results come in the calls' order
        else:
            _fail(f"{path}.tool_call_id", "missing, and every earlier tool call has its result")
        self.chat.open_calls = [(i, n) for i, n in self.chat.open_calls if i != call_id]
        out: Message = {"role": "tool", "content": content, "tool_call_id": call_id}
        out["name"] = self.chat.call_names[call_id]
        return out


def read_chat(
    messages: Any,
    path: str,
    *,
    tools_from: Mapping[str, Any] | None = None,
    tools_prefix: str = "",
) -> Conversation:
    """Read a message list (at ``path``), with the tools of ``tools_from`` (a row, or its ``input``)."""
    source = tools_from or {}
    tools, parallel = read_tools(source, tools_prefix)
    key = "functions" if source.get("tools") is None and source.get("functions") is not None else "tools"
    chat = Conversation(
        messages=[],
        weights=[],
        paths=[],
        tools=tools,
        parallel_tool_calls=parallel,
        tools_field=tools_prefix + key,
    )
    return continue_chat(chat, messages, path)


def continue_chat(
    chat: Conversation, messages: Any, path: str, *, only_assistant: bool = False, start: int = 0
) -> Conversation:
    """``chat`` followed by ``messages`` (at ``path``, numbered from ``start``): a new conversation;
    ``chat`` is left as it was. ``only_assistant``: every message must be the assistant's (a preference
    pair's outputs)."""
    out = Conversation(
        messages=list(chat.messages),
        weights=list(chat.weights),
        paths=list(chat.paths),
        tools=chat.tools,
        parallel_tool_calls=chat.parallel_tool_calls,
        tools_field=chat.tools_field,
        images=list(chat.images),
        open_calls=list(chat.open_calls),
        call_names=dict(chat.call_names),
    )
    reader = _Reader(out)
    for i, raw in enumerate(_array(messages, path)):
        reader.add(raw, f"{path}[{start + i}]", only_assistant=only_assistant)
    return out
