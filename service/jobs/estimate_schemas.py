"""The pre-flight estimate's answer, `fine_tuning.job.estimate` (POST /v1/fine_tuning/jobs/estimate)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class TrainedTokens(BaseModel):
    """Tokens the run processes, as the job's `trained_tokens` counts them (every input token of the
    trained examples), per epoch and for the run; `loss_per_epoch`: the positions the loss trains on."""

    per_epoch: int
    total: int
    loss_per_epoch: int


class Truncation(BaseModel):
    count: int  # examples longer than max_length (cut to it)
    first_lines: list[int]  # the first few of them (lines from 1)
    dropped_lines: list[int]  # examples cut so short that no trained token is left (not trained on)


class MemoryBreakdown(BaseModel):
    """Bytes per device at a step's peak, by part: ``trainers.memory_model.MemoryEstimate.as_dict``, field
    for field (tests/trainers/test_memory_model.py; written out, not generated, so that the type checker
    and the OpenAPI document see a plain model)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    reference: int
    total: int


class WorkerKind(BaseModel):
    device: str  # "cuda" or "cpu"
    device_name: str | None
    device_memory_bytes: int | None  # per device; a CPU worker: its RAM
    gpus: int  # devices it gives one job
    workers: int  # live workers of this kind


class DeviceFit(BaseModel):
    worker_kind: WorkerKind
    peak_memory_bytes: MemoryBreakdown
    fits: bool | None  # None: the device's memory is unknown
    reason: str | None = None  # why it does not fit


class WallTime(BaseModel):
    seconds: float | None
    reason: str | None = None  # why seconds is null, or what it was measured from
    tokens_per_second: float | None = None
    measured_jobs: int = 0


class PreviewSpan(BaseModel):
    text: str
    trained: bool  # the loss is taken on these tokens
    tokens: int
    # an image's tokens (the processor's expansion of its placeholder): its place among the row's images
    image: int | None = None


class ImageCounts(BaseModel):
    """A vision job's images: per epoch, and their tokens that take image features (a preference pair's
    twice: both its sequences hold the prompt); docs/vision.md."""

    per_epoch: int
    tokens_per_epoch: int


class EstimateObject(BaseModel):
    object: Literal["fine_tuning.job.estimate"] = "fine_tuning.job.estimate"
    model: str
    method: str
    examples: int  # rows of the training file
    trained_examples: int | None  # examples left with a trained token after truncation
    trained_tokens: TrainedTokens | None
    tokens_reason: str | None = None  # why trained_tokens is null
    total_steps: int
    truncated: Truncation | None
    images: ImageCounts | None = None  # rows with images on a vision base
    peak_memory_bytes: list[DeviceFit]  # one per kind of live training worker
    estimated_wall_time: WallTime
    queue_position: int  # if created now: 1 is the next job a free worker starts
    preview: list[list[PreviewSpan]]  # the first examples as trained: spans of trained / untrained text
    # whether the job can run as asked: false when it would train nothing (no token left to train on) or
    # fits no live worker; null when no live worker's memory is known
    fits: bool | None = None
    reason: str | None = None  # why fits is false or null
