"""What the API sends a worker to estimate a job's data, and what the worker answers: one source of truth
for both.

Why a worker: counting a job's tokens needs the model's tokenizer and the trainers' own tokenization and
loss mask (``trainers.data.sft``); the API process imports neither torch nor the trainers' data layer
(the import contract), and the bundled and fine-tuned models only exist as folders on the workers
(worker/models.py). So the API validates the body and reads the fleet from the database, and an
inference worker (the queue that answers requests, never behind a training job) reads the training file
and the model's tokenizer and config. It answers on the request's reply channel
(service/inference/replies.py) once: `{"type": "done", "model_config": {...}, "data": {...} | null}`, or
`{"type": "error", "status", "message", "param", "code"}`.
"""

from __future__ import annotations

from pydantic import BaseModel

ESTIMATE_TASK = "tunehouse.estimate_job"


class EstimateTask(BaseModel):
    request_id: str
    tenant_id: str
    model: str  # the job's `model`: a base model or the tenant's `ft:` model
    method_type: str
    training_blob_key: str
    max_length: int | None  # None: the method has no max_length (no token statistics)
    max_prompt_length: int | None = None  # preference methods: the prompt's cut (None: none)
    batch_size: int
    preview: int
    # unix time after which nobody waits for the answer: a worker that gets the message later drops it
    deadline: float
