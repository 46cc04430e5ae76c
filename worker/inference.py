"""Serve one inference request on an inference worker: load (or reuse) the model, generate, answer.

`serve_request` is the plain function behind the Celery task (worker/inference_app.py). It answers on
the request's reply channel (service/inference/replies.py, protocol in service/inference/task.py):
`start`, a `delta` per decoding step, `done`; or an `error` with the status the API should answer.
Checkpoints of a LoRA run hold only the adapter: they load as the job's base model + the adapter
(peft). Loaded models stay in an LRU cache (worker/model_cache.py) bounded by
`TUNEHOUSE_INFERENCE_MEMORY_BUDGET_MB`.
"""

from __future__ import annotations

import logging
import time
from functools import lru_cache
from typing import Any

from service.base_models.weights import ModelWeights
from service.config import Settings, get_settings
from service.inference.replies import ReplyWriter, reply_writer
from service.inference.task import InferenceTask
from service.storage import BlobStore, get_blob_store
from worker.model_cache import LoadedModel, ModelCache, model_bytes
from worker.models import resolve_model_path, unpack_checkpoint
from worker.replies import RequestRefused, errors_replied

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


def _prompt(task: InferenceTask, loaded: LoadedModel) -> tuple[list[int], dict[str, Any]]:
    """The prompt's token ids, and the model's other inputs for its rows (a vision model's pixels)."""
    from trainers.chat.rows import RowProblem
    from trainers.modeling.generation import chat_prompt_ids
    from trainers.modeling.vision import vision_prompt

    tokenizer = loaded.tokenizer
    if task.kind == "text":
        return [int(t) for t in tokenizer(task.prompt or "")["input_ids"]], {}
    if not getattr(tokenizer, "chat_template", None):
        raise RequestRefused(
            f"model: '{task.weights.model}' has no chat template; use /v1/completions", param="model"
        )
    messages = task.messages or []
    if loaded.processor is not None:
        try:
            return vision_prompt(loaded.processor, messages, n=task.n)
        except RowProblem as exc:
            raise RequestRefused(str(exc), param=exc.field or "messages") from exc
    if any(isinstance(m["content"], list) for m in messages):  # only a message with images has parts
        raise RequestRefused(
            f"messages: model '{task.weights.model}' takes text only; images need a vision-language "
            "model (docs/vision.md)",
            param="messages",
        )
    return chat_prompt_ids(tokenizer, messages), {}


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

    prompt, prompt_inputs = _prompt(task, loaded)
    _check_context(task, loaded.model, len(prompt))
    replies.send({"type": "start", "prompt_tokens": len(prompt)})
    generation = Generation(loaded.tokenizer, n=task.n, stop=task.stop)
    # torch seeds are unsigned 64-bit; OpenAI's seed is a signed integer
    seed = None if task.seed is None else task.seed % 2**64
    steps = generation.run(
        loaded.model,
        prompt,
        max_new_tokens=task.max_tokens,
        temperature=task.temperature,
        top_p=task.top_p,
        seed=seed,
        prompt_inputs=prompt_inputs,
    )
    for updates in steps:
        replies.send({"type": "delta", "choices": [list(u) for u in updates]})
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
