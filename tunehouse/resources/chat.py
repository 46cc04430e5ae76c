"""`client.chat.completions`: ask a model (a base model, a fine-tuned `ft:...` one or a checkpoint)
through `/v1/chat/completions`, whole (`create`) or as it is generated (`stream`). Trying a model, not a
serving engine (docs/api.md#trying-models)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from tunehouse._base_client import APIRequest, AsyncTransport, SyncTransport, compact, raw
from tunehouse._exceptions import status_error
from tunehouse._resource import AsyncAPIResource, SyncAPIResource, endpoint, parse_as, streamed
from tunehouse._streaming import SSEDecoder
from tunehouse.types import ChatCompletion, ChatCompletionChunk

CHAT = "/v1/chat/completions"
# a reply is generated token by token on an inference worker, whose first answer includes loading the model
CHAT_TIMEOUT = 300.0


def _chunks(decoder: SSEDecoder, line: str) -> Iterator[ChatCompletionChunk | None]:
    """The chunks one SSE line completes; None at `[DONE]`."""
    for sse in decoder.feed(line):
        if sse.data == "[DONE]":
            yield None
            return
        yield ChatCompletionChunk.model_validate(json.loads(sse.data))


@dataclass(frozen=True)
class ChatStream:
    """One streamed chat completion: not resumed after a dropped connection (the generation is gone)."""

    request: APIRequest[Any]

    def run_sync(self, transport: SyncTransport) -> Iterator[ChatCompletionChunk]:
        decoder = SSEDecoder()
        with transport.stream(self.request) as response:
            if not response.is_success:
                response.read()
                raise status_error(response)
            for line in response.iter_lines():
                for chunk in _chunks(decoder, line):
                    if chunk is None:
                        return
                    yield chunk

    async def run_async(self, transport: AsyncTransport) -> AsyncIterator[ChatCompletionChunk]:
        decoder = SSEDecoder()
        async with transport.stream(self.request) as response:
            if not response.is_success:
                await response.aread()
                raise status_error(response)
            async for line in response.aiter_lines():
                for chunk in _chunks(decoder, line):
                    if chunk is None:
                        return
                    yield chunk


def _body(
    model: str, messages: list[dict[str, Any]], max_tokens: int | None, temperature: float | None
) -> dict[str, Any]:
    return {"model": model, "messages": messages, **compact(max_tokens=max_tokens, temperature=temperature)}


class _Completions:
    @endpoint
    def create(
        self,
        *,
        model: str,
        messages: list[dict[str, Any]],
        max_tokens: int | None = None,
        temperature: float | None = None,
        timeout: float | None = None,
    ) -> APIRequest[ChatCompletion]:
        """The model's whole reply (not retried: each try would sample again)."""
        body = _body(model, messages, max_tokens, temperature)
        return APIRequest("POST", CHAT, parse_as(ChatCompletion), json=body, timeout=timeout or CHAT_TIMEOUT)

    @streamed
    def stream(
        self,
        *,
        model: str,
        messages: list[dict[str, Any]],
        max_tokens: int | None = None,
        temperature: float | None = None,
        timeout: float | None = None,
    ) -> ChatStream:
        """The reply as it is generated: `ChatCompletionChunk`s (`chunk.text` is the new text)."""
        body = {**_body(model, messages, max_tokens, temperature), "stream": True}
        return ChatStream(raw("POST", CHAT, json=body, timeout=timeout or CHAT_TIMEOUT))


class Completions(_Completions, SyncAPIResource):
    pass


class AsyncCompletions(_Completions, AsyncAPIResource):
    pass


class Chat:
    def __init__(self, transport: SyncTransport) -> None:
        self.completions = Completions(transport)


class AsyncChat:
    def __init__(self, transport: AsyncTransport) -> None:
        self.completions = AsyncCompletions(transport)
