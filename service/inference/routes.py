"""POST /v1/chat/completions and /v1/completions: try a base model, a fine-tuned model or a checkpoint.

For trying and evaluating models, not a serving engine (docs/api.md: serve a downloaded model with vLLM).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from service.auth import TenantDep
from service.base_models.weights import ModelWeights
from service.config import Settings
from service.dependencies import SessionDep, SettingsDep
from service.errors import AppError, error_responses
from service.ids import new_id, now
from service.inference.chat import read_request
from service.inference.images import check_images
from service.inference.responses import Choice, Shape, usage
from service.inference.schemas import ChatCompletionRequest, CompletionRequest, SamplingRequest
from service.inference.service import Answer, build_task, resolve_weights, start_inference
from service.inference.task import ChatRequest

router = APIRouter(prefix="/v1", tags=["inference"], responses=error_responses(400, 401, 404, 503))


@router.post("/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, session: SessionDep, tenant: TenantDep, settings: SettingsDep
) -> Response:
    """OpenAI's chat completions (plain, or `stream: true` as `chat.completion.chunk` events), with tools:
    the reply's `tool_calls` and `reasoning_content` read from the output with the model's chat format;
    image parts for a vision model (docs/vision.md), checked here (an http(s) one fetched)."""
    await run_in_threadpool(check_images, body, settings)
    chat = read_request(body)
    weights = await _resolve(session, settings, tenant.id, body.model)
    shape = Shape(True, new_id("chatcmpl"), now(), body.model, functions=chat.legacy_functions)
    return await _complete(body, weights, settings, shape, chat)


@router.post("/completions")
async def completions(
    body: CompletionRequest, session: SessionDep, tenant: TenantDep, settings: SettingsDep
) -> Response:
    """OpenAI's (legacy) text completions: the prompt as given, no chat template."""
    weights = await _resolve(session, settings, tenant.id, body.model)
    return await _complete(body, weights, settings, Shape(False, new_id("cmpl"), now(), body.model))


async def _resolve(session: SessionDep, settings: Settings, tenant_id: str, model: str) -> ModelWeights:
    def resolve() -> ModelWeights:
        weights = resolve_weights(session, settings, tenant_id=tenant_id, model=model)
        # end the transaction now: its pooled connection must not wait for a generation to finish
        session.commit()
        return weights

    return await run_in_threadpool(resolve)


async def _complete(
    body: SamplingRequest,
    weights: ModelWeights,
    settings: Settings,
    shape: Shape,
    chat: ChatRequest | None = None,
) -> Response:
    task = build_task(settings, body, weights, shape.id, chat)
    answer = await start_inference(settings, task)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            _stream(answer, shape, n=body.n, include_usage=include_usage),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )
    choices = [Choice() for _ in range(body.n)]
    completion_tokens = 0
    async for message in answer.messages():
        if message["type"] == "delta":
            for index, piece, reason in message["choices"]:
                choices[index].add(piece, reason)
        else:
            completion_tokens = int(message["completion_tokens"])
    return JSONResponse(shape.completion(choices, usage(answer.prompt_tokens, completion_tokens)))


def _frame(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def _stream(answer: Answer, shape: Shape, *, n: int, include_usage: bool) -> AsyncIterator[bytes]:
    """OpenAI's SSE: one `data:` chunk per piece (responses.py), a last one per choice with its finish reason,
    the usage if asked, then `data: [DONE]`. A failure mid-stream is an `error` chunk and no [DONE]
    (the status line is long gone), which the openai client raises as an APIError."""
    try:
        if shape.chat:
            for index in range(n):
                yield _frame(shape.chunk(index, None, None, role=True))
        async for message in answer.messages():
            if message["type"] == "delta":
                for index, piece, reason in message["choices"]:
                    if piece:
                        yield _frame(shape.chunk(index, piece, None))
                    if reason:
                        yield _frame(shape.chunk(index, None, reason))
            elif include_usage:
                yield _frame(
                    shape.usage_chunk(usage(answer.prompt_tokens, int(message["completion_tokens"])))
                )
        yield b"data: [DONE]\n\n"
    except AppError as exc:
        yield _frame(exc.body())
