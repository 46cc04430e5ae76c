"""What the API sends an inference worker, and what the worker answers: one source of truth for both.

The task carries the resolved weights (service/base_models/weights.py), the prompt and the sampling
settings, never a session or an object. The worker answers on the request's reply channel
(service/inference/replies.py) with, in order:

- `{"type": "start", "prompt_tokens": P}` once the model is loaded and the prompt tokenized;
- `{"type": "delta", "choices": [[index, text, finish_reason | null], ...]}` per decoding step;
- `{"type": "done", "completion_tokens": C}`;
- or at any point `{"type": "error", "status": 400|404|500, "message", "param", "code"}`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from service.base_models.weights import ModelWeights

INFER_TASK = "tunehouse.infer"
# Inference has its own queue, consumed by its own worker process (`tunehouse worker --inference`):
# a training worker runs one job for hours and would keep a request waiting behind it.
INFERENCE_QUEUE = "tunehouse.inference"


class InferenceTask(BaseModel):
    request_id: str
    weights: ModelWeights
    kind: Literal["chat", "text"]
    messages: list[dict[str, Any]] | None = None  # kind == "chat": role + plain-text content
    prompt: str | None = None  # kind == "text"
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    stop: list[str]
    seed: int | None
    # unix time after which nobody waits for the answer: a worker that gets the message later drops it
    deadline: float
