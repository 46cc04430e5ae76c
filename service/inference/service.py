"""Trying a model: resolve it for the tenant, send the request to an inference worker, read its answer.

The API process never loads a model. It sends an `InferenceTask` to the inference queue and reads the
worker's messages from the request's reply channel (replies.py). What a client sees when something is
missing: an unknown model or another tenant's is a 404 (before anything is sent); the broker or Redis
down is a 503 with Retry-After; no inference worker answering within
`TUNEHOUSE_INFERENCE_TIMEOUT_SECONDS` is a 503 saying so.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.base_models.weights import ModelWeights, find_model_weights
from service.config import Settings
from service.errors import RETRY_AFTER_SECONDS, AppError, BadRequest, NotFound, ServiceUnavailable
from service.inference.replies import Message, ReplyChannelDown, ReplyReader, reply_reader
from service.inference.schemas import CompletionRequest, SamplingRequest
from service.inference.task import INFER_TASK, INFERENCE_QUEUE, ChatRequest, InferenceTask
from service.queue import send_task


class WorkerError(AppError):
    """An error the inference worker reported; its status is the worker's."""

    def __init__(self, message: Message) -> None:
        super().__init__(str(message.get("message")), param=message.get("param"), code=message.get("code"))
        self.status_code = int(message.get("status", 500))
        self.type = "invalid_request_error" if self.status_code < 500 else "server_error"

    def headers(self) -> dict[str, str] | None:
        return {"retry-after": str(RETRY_AFTER_SECONDS)} if self.status_code == 503 else None


def resolve_weights(session: Session, settings: Settings, *, tenant_id: str, model: str) -> ModelWeights:
    weights = find_model_weights(session, settings, tenant_id=tenant_id, name=model)
    if weights is None:
        raise NotFound(f"The model '{model}' does not exist", param="model", code="model_not_found")
    if weights.reward_model:
        raise BadRequest(
            f"model: '{model}' is a reward model; it scores text and cannot generate it",
            param="model",
            code="model_not_generative",
        )
    return weights


def build_task(
    settings: Settings,
    request: SamplingRequest,
    weights: ModelWeights,
    request_id: str,
    chat: ChatRequest | None = None,
) -> InferenceTask:
    """The task for ``request`` (``chat``: a chat request's conversation, read by read_request)."""
    max_tokens, param = request.wanted_tokens()
    if max_tokens is not None and max_tokens > settings.inference_max_tokens:
        raise BadRequest(
            f"{param}: at most {settings.inference_max_tokens} on this deployment, not {max_tokens}",
            param=param,
            code="invalid_value",
        )
    common: dict[str, Any] = {
        "request_id": request_id,
        "weights": weights,
        "max_tokens": max_tokens or settings.inference_default_max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "n": request.n,
        "stop": request.stop_list(),
        "seed": request.seed,
        "deadline": time.time() + settings.inference_timeout_seconds,
    }
    if chat is not None:
        return InferenceTask(kind="chat", chat=chat, **common)
    assert isinstance(request, CompletionRequest)
    return InferenceTask(kind="text", prompt=request.prompt, **common)


def channel_down(exc: Exception) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"Redis, which carries answers back from the inference workers, is unavailable ({exc}); "
        "retry in a few seconds.",
        code="redis_unavailable",
    )


@dataclass
class Answer:
    """A request an inference worker has started on: `prompt_tokens` known, the rest to read."""

    request_id: str
    prompt_tokens: int
    reader: ReplyReader
    timeout: float

    async def messages(self) -> AsyncIterator[Message]:
        """The worker's `delta` messages up to (and including) `done`; raises AppError on an error,
        a timeout or the channel going down."""
        try:
            while True:
                message = await self.reader.receive(self.timeout)
                if message is None:
                    raise ServiceUnavailable(
                        f"The inference worker stopped answering for {self.timeout:.0f}s",
                        code="inference_timeout",
                    )
                if message["type"] == "error":
                    raise WorkerError(message)
                yield message
                if message["type"] == "done":
                    return
        except ReplyChannelDown as exc:
            raise channel_down(exc) from exc
        finally:
            await self.reader.close()


async def first_answer(
    settings: Settings, reader: ReplyReader, *, task: str, payload: dict[str, Any], why: str = ""
) -> Message:
    """Send `task` to the inference queue and read the worker's first message on `reader`; AppError
    when the broker is down, no worker answers in time (`why`: what the worker was needed for) or the
    worker answers an error. ReplyChannelDown passes through."""
    await reader.check()  # fail before sending: a worker's answer could not come back anyway
    sent = await run_in_threadpool(
        send_task, task, [payload], queue=INFERENCE_QUEUE, expires=settings.inference_timeout_seconds
    )
    if not sent:
        raise ServiceUnavailable(
            "The task broker is unavailable; retry in a few seconds.", code="broker_unavailable"
        )
    first = await reader.receive(settings.inference_timeout_seconds)
    if first is None:
        raise ServiceUnavailable(
            f"No inference worker answered within {settings.inference_timeout_seconds:.0f}s; "
            f"is one running (`tunehouse worker --inference`)?{why}",
            code="no_inference_worker",
        )
    if first["type"] == "error":
        raise WorkerError(first)
    return first


async def start_inference(settings: Settings, task: InferenceTask) -> Answer:
    """Send `task` and wait for the worker to start on it (model loaded, prompt tokenized)."""
    reader = reply_reader(settings, task.request_id)
    try:
        first = await first_answer(settings, reader, task=INFER_TASK, payload=task.model_dump(mode="json"))
    except ReplyChannelDown as exc:
        await reader.close()
        raise channel_down(exc) from exc
    except BaseException:
        await reader.close()
        raise
    return Answer(task.request_id, int(first["prompt_tokens"]), reader, settings.inference_timeout_seconds)
