"""The job spec: one pydantic source of truth, used by the API to validate and by the worker to run.

A method object has OpenAI's shape, `{"type": T, T: {"hyperparameters": {...}}}`. Hyperparameters
accept OpenAI's names (`n_epochs`, `batch_size`, `learning_rate_multiplier`, each a number or "auto")
plus ours; "auto" is resolved at creation (`resolve_supervised`) and stored resolved.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Auto = Literal["auto"]
METHOD_TYPES = ("supervised", "dpo", "reinforcement", "grpo", "ppo", "reward_model")
# methods whose trainers have landed; the others answer a clear 400 until they do
RUNNABLE_METHODS = ("supervised",)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SupervisedHyperparameters(_Strict):
    """Supervised fine-tuning. OpenAI's three knobs, then ours."""

    n_epochs: Annotated[int, Field(ge=1, le=100)] | Auto = "auto"
    batch_size: Annotated[int, Field(ge=1, le=1024)] | Auto = "auto"
    learning_rate_multiplier: Annotated[float, Field(gt=0, le=100)] | Auto = "auto"
    # ours: the adapter
    lora: bool = True
    lora_r: Annotated[int, Field(ge=1, le=1024)] = 8
    lora_alpha: Annotated[int, Field(ge=1, le=4096)] = 16
    lora_dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    lora_target_modules: list[str] | None = None
    # ours: data
    max_length: Annotated[int, Field(ge=8, le=131072)] = 1024
    packing: bool = False
    # ours: optimisation
    learning_rate: Annotated[float, Field(gt=0, le=1)] | None = None  # absolute; overrides the multiplier
    gradient_accumulation_steps: Annotated[int, Field(ge=1, le=1024)] = 1
    lr_scheduler: Literal["linear", "cosine", "constant"] = "linear"
    warmup_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0
    weight_decay: Annotated[float, Field(ge=0, le=1)] = 0.0
    max_grad_norm: Annotated[float, Field(gt=0)] = 1.0
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    gradient_checkpointing: bool = False
    max_steps: Annotated[int, Field(ge=1)] | None = None
    save_steps: Annotated[int, Field(ge=0)] = 0
    eval_steps: Annotated[int, Field(ge=0)] = 0


class SupervisedMethod(_Strict):
    hyperparameters: SupervisedHyperparameters = Field(default_factory=SupervisedHyperparameters)


class OpaqueMethod(BaseModel):
    """Methods whose trainers have not landed yet: kept loose so the 400 names the method, not a field."""

    model_config = ConfigDict(extra="allow")


class Method(_Strict):
    type: Literal["supervised", "dpo", "reinforcement", "grpo", "ppo", "reward_model"]
    supervised: SupervisedMethod | None = None
    dpo: OpaqueMethod | None = None
    reinforcement: OpaqueMethod | None = None
    grpo: OpaqueMethod | None = None
    ppo: OpaqueMethod | None = None
    reward_model: OpaqueMethod | None = None

    @model_validator(mode="after")
    def _one_body(self) -> Method:
        for other in METHOD_TYPES:
            if other != self.type and getattr(self, other) is not None:
                raise ValueError(f"method.{other} given but method.type is '{self.type}'")
        if self.type == "supervised" and self.supervised is None:
            self.supervised = SupervisedMethod()
        return self


class LegacyHyperparameters(_Strict):
    """OpenAI's deprecated top-level `hyperparameters` (supervised only)."""

    n_epochs: Annotated[int, Field(ge=1, le=100)] | Auto = "auto"
    batch_size: Annotated[int, Field(ge=1, le=1024)] | Auto = "auto"
    learning_rate_multiplier: Annotated[float, Field(gt=0, le=100)] | Auto = "auto"


class JobCreate(_Strict):
    model: str = Field(min_length=1, max_length=500)
    training_file: str = Field(min_length=1)
    validation_file: str | None = None
    hyperparameters: LegacyHyperparameters | None = None
    method: Method | None = None
    suffix: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)
    integrations: list[dict[str, Any]] | None = None


# Base learning rates the multiplier scales; full fine-tuning moves every weight, so it gets a smaller one.
BASE_LR_LORA = 2e-4
BASE_LR_FULL = 2e-5


def resolve_supervised(hp: SupervisedHyperparameters, *, n_examples: int) -> SupervisedHyperparameters:
    """Replace every "auto" with a number chosen from the dataset size."""
    # batch: 1/8 of the data, between 1 and 8 — small sets still get several steps per epoch
    batch_size = hp.batch_size if hp.batch_size != "auto" else max(1, min(8, n_examples // 8))
    # epochs: aim for ~256 example-passes on small sets, never fewer than 1 or more than 10
    n_epochs = hp.n_epochs if hp.n_epochs != "auto" else max(1, min(10, math.ceil(256 / max(1, n_examples))))
    multiplier = hp.learning_rate_multiplier if hp.learning_rate_multiplier != "auto" else 1.0
    return hp.model_copy(
        update={"batch_size": batch_size, "n_epochs": n_epochs, "learning_rate_multiplier": multiplier}
    )


def learning_rate(hp: SupervisedHyperparameters) -> float:
    if hp.learning_rate is not None:
        return hp.learning_rate
    assert hp.learning_rate_multiplier != "auto", "hyperparameters must be resolved first"
    return (BASE_LR_LORA if hp.lora else BASE_LR_FULL) * hp.learning_rate_multiplier


def stored_method(method: Method) -> dict[str, Any]:
    return method.model_dump(mode="json", exclude_none=True)


def load_method(data: dict[str, Any]) -> Method:
    return Method.model_validate(data)
