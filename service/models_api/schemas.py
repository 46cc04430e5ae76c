"""The model objects of /v1/models: OpenAI's (`id`, `object`, `created`, `owned_by`) plus, for a base
model, what it is and what this deployment can train on it (service/base_models/details.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class Trainable(BaseModel):
    methods: list[str]
    lora: bool
    full: bool
    quantization: list[str]
    # why nothing trains, when nothing does
    reason: str | None = None


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    # base models only (None for fine-tuned ones)
    architecture: str | None = None
    parameters: int | None = None
    context_length: int | None = None
    chat_template: str | None = None
    modalities: list[str] | None = None
    trainable: Trainable | None = None
    # the catalogue's models (`tunehouse models add`): where from, the pinned revision, stored bytes
    source: str | None = None
    revision: str | None = None
    bytes: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class ModelDeleted(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool = True
