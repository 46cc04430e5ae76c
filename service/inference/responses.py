"""OpenAI's response objects: `chat.completion` / `chat.completion.chunk` and `text_completion`.

A chat reply carries what the worker read from the model's output with its chat format (task.py's
pieces): `content`, `reasoning_content` (beside the content, as vLLM and DeepSeek return it), and
`tool_calls` with `finish_reason: "tool_calls"`; a request with the legacy `functions` gets its call as
`function_call` and `finish_reason: "function_call"`, as OpenAI answers those. Streamed, each piece is a
chunk of its own: `delta.content`, `delta.reasoning_content`, or `delta.tool_calls[{index, id, type,
function: {name, arguments}}]` (a call whole, in one chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Choice:
    """One choice's answer, gathered from the worker's pieces."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # task.py's calls
    finish_reason: str | None = None

    def add(self, piece: dict[str, Any] | None, reason: str | None) -> None:
        if piece is not None:
            self.content += piece.get("content", "")
            self.reasoning += piece.get("reasoning_content", "")
            if "tool_call" in piece:
                self.tool_calls.append(piece["tool_call"])
        self.finish_reason = reason or self.finish_reason


def _call(call: dict[str, Any]) -> dict[str, Any]:
    return {"name": call["name"], "arguments": call["arguments"]}


@dataclass(frozen=True)
class Shape:
    """One completion request's identity; renders whole answers and streamed chunks for chat or text.
    `functions`: a chat request with the legacy `functions` (its calls answered as `function_call`)."""

    chat: bool
    id: str
    created: int
    model: str
    functions: bool = False

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _reason(self, reason: str | None) -> str | None:
        return "function_call" if self.functions and reason == "tool_calls" else reason

    def _calls(self, calls: list[dict[str, Any]], *, streamed: bool) -> dict[str, Any]:
        if self.functions:
            return {"function_call": _call(calls[0])}
        return {
            "tool_calls": [
                {
                    **({"index": c["index"]} if streamed else {}),
                    "id": c["id"],
                    "type": "function",
                    "function": _call(c),
                }
                for c in calls
            ]
        }

    def _message(self, choice: Choice) -> dict[str, Any]:
        # OpenAI's content is null beside tool calls when the model wrote none
        content = choice.content if choice.content or not choice.tool_calls else None
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if choice.reasoning:
            message["reasoning_content"] = choice.reasoning
        if choice.tool_calls:
            message.update(self._calls(choice.tool_calls, streamed=False))
        return message

    def completion(self, choices: list[Choice], usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            out: list[dict[str, Any]] = [
                {
                    "index": i,
                    "message": self._message(c),
                    "finish_reason": self._reason(c.finish_reason),
                    "logprobs": None,
                }
                for i, c in enumerate(choices)
            ]
            return {**self._head("chat.completion"), "choices": out, "usage": usage}
        out = [
            {"index": i, "text": c.content, "finish_reason": c.finish_reason, "logprobs": None}
            for i, c in enumerate(choices)
        ]
        return {**self._head("text_completion"), "choices": out, "usage": usage}

    def chunk(
        self, index: int, piece: dict[str, Any] | None, reason: str | None, *, role: bool = False
    ) -> dict[str, Any]:
        """A streamed piece of choice `index` (task.py's), or (piece None) the end with its reason."""
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif piece is not None and "tool_call" in piece:
                delta = self._calls([piece["tool_call"]], streamed=True)
            elif piece is not None:
                delta = dict(piece)
            choice = {"index": index, "delta": delta, "finish_reason": self._reason(reason), "logprobs": None}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        text = "" if piece is None else piece.get("content", "")
        choice = {"index": index, "text": text, "finish_reason": reason, "logprobs": None}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """The last chunk when `stream_options.include_usage` is set: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
