"""Serve one inference request on an inference worker: load (or reuse) the model, generate, answer.

`serve_request` is the plain function behind the Celery task (worker/inference_app.py). It answers on
the request's reply channel (service/inference/replies.py, protocol in service/inference/task.py):
`start`, a `delta` per decoding step, `done`; or an `error` with the status the API should answer.
A chat request is rendered by the model's own template with its tools (trainers/data/chat_prompt.py)
and each choice's output read back with the template's chat format as it is written (``ChoiceReply``:
content, reasoning, whole tool calls). Checkpoints of a LoRA run hold only the adapter: they load as the
job's base model + the adapter (peft). Loaded models stay in an LRU cache (worker/model_cache.py) bounded by
`TUNEHOUSE_INFERENCE_MEMORY_BUDGET_MB`.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import asdict
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from service.base_models.weights import ModelWeights
from service.config import Settings, get_settings
from service.inference.replies import ReplyWriter, reply_writer
from service.inference.task import ChatRequest, InferenceTask
from service.storage import BlobStore, get_blob_store
from worker.model_cache import LoadedModel, ModelCache, model_bytes
from worker.models import resolve_model_path, unpack_checkpoint
from worker.replies import RequestRefused, errors_replied

if TYPE_CHECKING:
    from trainers.chat.formats import Delta
    from trainers.data.chat_prompt import ChatPrompt

log = logging.getLogger("tunehouse.inference")


@lru_cache
def model_cache() -> ModelCache:
    return ModelCache(get_settings().inference_memory_budget_mb * 2**20)


def load_weights(settings: Settings, blobs: BlobStore, weights: ModelWeights) -> LoadedModel:
    from trainers.modeling.generation import load_causal_lm, load_with_adapter
    from trainers.modeling.vision import is_vision_model, load_vision_for_serving

    def base() -> str:
        return resolve_model_path(settings, blobs, tenant_id=weights.tenant_id, name=weights.base)

    if weights.checkpoint_id is None or weights.blob_key is None:
        path, adapter = base(), None
    else:
        folder = unpack_checkpoint(
            settings, blobs, checkpoint_id=weights.checkpoint_id, blob_key=weights.blob_key
        )
        path, adapter = (base(), folder) if (folder / "adapter_config.json").exists() else (str(folder), None)
    if is_vision_model(path):  # a vision-language model: its processor reads the chat's images
        model, processor = load_vision_for_serving(path, adapter)
        return LoadedModel(model, processor.tokenizer, model_bytes(model), processor)
    model, tokenizer = load_with_adapter(path, adapter) if adapter is not None else load_causal_lm(path)
    return LoadedModel(model, tokenizer, model_bytes(model))


def _chat_prompt(task: InferenceTask, asked: ChatRequest, tokenizer: Any) -> ChatPrompt:
    """The request's conversation rendered with its tools and tool choice; the template's refusals as
    400s naming the request's parameter."""
    from trainers.chat.rows import Conversation
    from trainers.data.chat import ChatDataError
    from trainers.data.chat_prompt import chat_prompt

    if not getattr(tokenizer, "chat_template", None):
        raise RequestRefused(
            f"model: '{task.weights.model}' has no chat template; use /v1/completions", param="model"
        )
    chat = Conversation(
        messages=asked.messages,
        weights=[0] * len(asked.messages),  # the same paths as the API's read_chat gave them
        paths=[f"messages[{i}]" for i in range(len(asked.messages))],
        tools=asked.tools,
        tools_field=asked.tools_field,
    )
    try:
        return chat_prompt(tokenizer, chat, tool_choice=asked.tool_choice, function=asked.tool_name)
    except ChatDataError as exc:
        param = exc.field or "messages"
        raise RequestRefused(f"{param}: {exc.reason}", param=param) from exc


class ChoiceReply:
    """One choice's reply read with the model's chat format (``trainers.chat.formats``) as the model
    writes it: each piece of text in, the reply's pieces out (task.py's protocol). ``single_call``: the
    reply ends at its first tool call."""

    def __init__(self, prompt: ChatPrompt, *, single_call: bool) -> None:
        before = prompt.text[: len(prompt.text) - len(prompt.prefill)]
        self.reader = prompt.format.reader(before, tool_calls=prompt.tool_calls)
        self.early: list[Delta] = self.reader.feed(prompt.prefill)  # the forced start of a call
        self.single_call = single_call
        self.calls = 0
        self.ended = False

    def read(self, text: str, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The pieces ``text`` completes, and the choice's finish reason: ``reason`` (the model's), or
        ``tool_calls`` where it called a tool and stopped or, ``single_call``, called one."""
        if self.ended:  # what the model writes after its one call is not part of the reply
            return [], None
        deltas, self.early = [*self.early, *self.reader.feed(text)], []
        if reason is not None:
            deltas += self.reader.close()
        pieces: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.reasoning:
                pieces.append({"reasoning_content": delta.reasoning})
            if delta.content:
                pieces.append({"content": delta.content})
            if delta.tool_call is not None:
                call = {"index": self.calls, "id": f"call_{uuid.uuid4().hex[:24]}"}
                pieces.append({"tool_call": {**call, **asdict(delta.tool_call)}})
                self.calls += 1
                if self.single_call:
                    self.ended = True
                    return pieces, "tool_calls"
        if reason == "stop" and self.calls:
            return pieces, "tool_calls"
        return pieces, reason


def _check_context(task: InferenceTask, model: Any, prompt_tokens: int) -> None:
    context = getattr(model.config, "max_position_embeddings", None)
    if isinstance(context, int) and prompt_tokens + task.max_tokens > context:
        prompt = "prompt" if task.kind == "text" else "messages"  # /v1/completions' name, or chat's
        param = prompt if prompt_tokens >= context else "max_tokens"
        raise RequestRefused(
            f"{param}: the prompt ({prompt_tokens} tokens) plus max_tokens ({task.max_tokens}) exceed "
            f"the model's context of {context} tokens",
            param=param,
        )


def generate(task: InferenceTask, loaded: LoadedModel, replies: ReplyWriter) -> None:
    from trainers.modeling.generation import Generation

    tokenizer = loaded.tokenizer
    prompt_inputs: dict[str, Any] = {}
    if task.kind == "text":
        prompt_ids = [int(t) for t in tokenizer(task.prompt or "")["input_ids"]]
        readers = None
        keep: tuple[str, ...] = ()
    else:
        assert task.chat is not None
        if task.chat.images and loaded.processor is None:  # (before its template meets an image)
            raise RequestRefused(
                f"messages: model '{task.weights.model}' takes text only; images need a vision-language "
                "model (docs/vision.md)",
                param="messages",
            )
        prompt = _chat_prompt(task, task.chat, tokenizer)
        if task.chat.images:  # expanded, and their pixels made, by the processor's own call
            from trainers.modeling.vision import vision_prompt

            prompt_ids, prompt_inputs = vision_prompt(
                loaded.processor, prompt.text, task.chat.images, n=task.n
            )
        else:
            prompt_ids = [int(t) for t in tokenizer(prompt.text, add_special_tokens=False)["input_ids"]]
        readers = [ChoiceReply(prompt, single_call=task.chat.single_tool_call) for _ in range(task.n)]
        keep = prompt.format.markers
    _check_context(task, loaded.model, len(prompt_ids))
    replies.send({"type": "start", "prompt_tokens": len(prompt_ids)})
    generation = Generation(tokenizer, n=task.n, stop=task.stop, keep=keep)
    # torch seeds are unsigned 64-bit; OpenAI's seed is a signed integer
    seed = None if task.seed is None else task.seed % 2**64
    steps = generation.run(
        loaded.model,
        prompt_ids,
        max_new_tokens=task.max_tokens,
        temperature=task.temperature,
        top_p=task.top_p,
        seed=seed,
        prompt_inputs=prompt_inputs,
    )
    for updates in steps:
        entries: list[list[Any]] = []
        for index, text, reason in updates:
            if readers is None:
                pieces, finish = ([{"content": text}] if text else []), reason
            else:
                pieces, finish = readers[index].read(text, reason)
                if finish is not None and reason is None:  # the reply ended before the model: stop it
                    generation.end(index, finish)
            entries += [[index, piece, None] for piece in pieces]
            if finish is not None:
                entries.append([index, None, finish])
        if entries:
            replies.send({"type": "delta", "choices": entries})
    replies.send({"type": "done", "completion_tokens": generation.completion_tokens})


def serve_request(payload: dict[str, Any]) -> None:
    task = InferenceTask.model_validate(payload)
    if time.time() > task.deadline:
        log.info("inference %s: dropped, its client stopped waiting", task.request_id)
        return
    settings = get_settings()
    replies = reply_writer(settings, task.request_id)
    with errors_replied(
        replies,
        request_id=task.request_id,
        log=log,
        failed=f"The inference worker failed on request {task.request_id}",
        code="inference_failed",
    ):
        key = task.weights.checkpoint_id or f"base:{task.weights.base}"
        loaded = model_cache().get(key, lambda: load_weights(settings, get_blob_store(), task.weights))
        generate(task, loaded, replies)
