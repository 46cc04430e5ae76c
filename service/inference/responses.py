"""OpenAI's response objects: `chat.completion` / `chat.completion.chunk` and `text_completion`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Shape:
    """One completion request's identity; renders whole answers and streamed chunks for chat or text."""

    chat: bool
    id: str
    created: int
    model: str

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def completion(
        self, texts: list[str], reasons: list[str | None], usage: dict[str, int]
    ) -> dict[str, Any]:
        if self.chat:
            choices: list[dict[str, Any]] = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text, "refusal": None},
                    "finish_reason": reason,
                    "logprobs": None,
                }
                for i, (text, reason) in enumerate(zip(texts, reasons, strict=True))
            ]
            return {**self._head("chat.completion"), "choices": choices, "usage": usage}
        choices = [
            {"index": i, "text": text, "finish_reason": reason, "logprobs": None}
            for i, (text, reason) in enumerate(zip(texts, reasons, strict=True))
        ]
        return {**self._head("text_completion"), "choices": choices, "usage": usage}

    def chunk(
        self, index: int, text: str | None, reason: str | None, *, role: bool = False
    ) -> dict[str, Any]:
        """A streamed piece of choice `index`: new text, or (text None) the end with its reason."""
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif text is not None:
                delta = {"content": text}
            choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": None}
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
