"""What the API sends an inference worker, and what the worker answers: one source of truth for both.

The task carries the resolved weights (service/base_models/weights.py), the prompt and the sampling
settings, never a session or an object. The worker answers on the request's reply channel
(service/inference/replies.py) with, in order:

- `{"type": "start", "prompt_tokens": P}` once the model is loaded and the prompt tokenized;
- `{"type": "delta", "choices": [[index, piece | null, finish_reason | null], ...]}` per decoding step,
  where a piece is one of `{"content": text}`, `{"reasoning_content": text}` or `{"tool_call": {"index",
  "id", "name", "arguments"}}` (a whole call, its arguments a JSON object's text), in the order the model
  wrote them, and a choice's finish reason comes with its last entry (`tool_calls` where it called a tool);
- `{"type": "done", "completion_tokens": C}`;
- or at any point `{"type": "error", "status": 400|404|500, "message", "param", "code"}`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from service.base_models.weights import ModelWeights
from trainers.chat.formats import ToolChoice

INFER_TASK = "tunehouse.infer"
# Inference has its own queue, consumed by its own worker process (`tunehouse worker --inference`):
# a training worker runs one job for hours and would keep a request waiting behind it.
INFERENCE_QUEUE = "tunehouse.inference"


class ChatRequest(BaseModel):
    """A chat request's conversation as chat templates read it (trainers.chat.rows.read_chat, by
    service/inference/chat.py) and what it asks of the reply."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tools_field: str = "tools"  # the request's parameter that gave them ("functions": the legacy one)
    tool_choice: ToolChoice = "none"
    tool_name: str | None = None  # the function a "function" tool_choice names
    single_tool_call: bool = False  # end each choice at its first call (parallel_tool_calls false, functions)
    legacy_functions: bool = False  # the reply's call as `function_call` (the API's concern: responses.py)
    # the images of the messages, in order, as data URLs (checked by service/inference/images.py): a
    # vision model's processor reads them where the template put their placeholders (docs/vision.md)
    images: list[str] = []


class InferenceTask(BaseModel):
    request_id: str
    weights: ModelWeights
    kind: Literal["chat", "text"]
    chat: ChatRequest | None = None  # kind == "chat"
    prompt: str | None = None  # kind == "text"
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    stop: list[str]
    seed: int | None
    # unix time after which nobody waits for the answer: a worker that gets the message later drops it
    deadline: float
