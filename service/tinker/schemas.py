"""The JSON bodies of the Tinker protocol that tunehouse serves (the official SDK's field names). Fields
the SDK sends that tunehouse does not use are accepted and ignored (`extra="ignore"`), so a newer SDK
that adds one still works; a field whose value asks for something unsupported is refused by the route.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _In(BaseModel):
    # NaN and infinity are refused at the boundary (Python's json writes and reads them)
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)


class CreateSession(_In):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""


class SessionRef(_In):
    session_id: str


class LoraSpec(_In):
    rank: int = Field(ge=1, le=1024)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(_In):
    type: str = "adamw"


class CreateModel(_In):
    session_id: str
    model_seq_id: int = 0
    base_model: str = Field(min_length=1)
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraSpec | None = None
    optimizer_config: OptimizerConfig | None = None


class ModelRef(_In):
    model_id: str


class AdamParams(_In):
    # the bounds refuse what can only be a mistake (a learning rate of 1e308 turns every weight to inf)
    # and stay far wider than any run uses: LoRA learning rates are 1e-6..1e-2
    learning_rate: float = Field(default=1e-4, ge=0, le=10)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-12, gt=0, le=1)
    weight_decay: float = Field(default=0.0, ge=0, le=10)
    grad_clip_norm: float = Field(default=0.0, ge=0, le=1e6)


class OptimStep(_In):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeights(_In):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"
    ttl_seconds: int | None = Field(default=None, ge=1, le=10 * 365 * 86400)


class FinishReason(_In):
    type: str = "success"


class FinishSession(_In):
    reason: FinishReason = FinishReason()
    detail: str | None = None


class CheckpointTtl(_In):
    ttl_seconds: int | None = Field(default=None, ge=1, le=10 * 365 * 86400)


class WeightsInfo(_In):
    tinker_path: str


class LoadWeights(_In):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool = False


class CreateSamplingSession(_In):
    session_id: str
    sampling_session_seq_id: int = 0
    base_model: str | None = None
    model_path: str | None = None


class Chunk(_In):
    type: str = "encoded_text"
    tokens: list[int] = []


class ModelInput(_In):
    chunks: list[Chunk]


class SamplingParams(_In):
    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(default=1.0, ge=0)
    top_k: int = Field(default=-1, ge=-1)
    top_p: float = Field(default=1.0, gt=0, le=1)


class Sample(_In):
    num_samples: int = Field(default=1, ge=1, le=128)
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=64)
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: int = 0
    record_stability_info: bool | None = None


class RetrieveFuture(_In):
    request_id: str
    allow_metadata_only: bool = False
