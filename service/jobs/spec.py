"""The job spec: one pydantic source of truth, used by the API to validate and by the worker to run.

A method object has OpenAI's shape, `{"type": T, T: {"hyperparameters": {...}}}`. Hyperparameters
accept OpenAI's names (`n_epochs`, `batch_size`, `learning_rate_multiplier`, `beta`, each a number or
"auto") plus ours; "auto" is resolved at creation (`resolve_hyperparameters`) and stored resolved.
Field names match the trainers' config dataclasses, so the worker maps them by name.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.jobs.graders import Grader

Auto = Literal["auto"]
MethodType = Literal["supervised", "dpo", "reinforcement", "grpo", "ppo", "reward_model"]
METHOD_TYPES: tuple[str, ...] = ("supervised", "dpo", "reinforcement", "grpo", "ppo", "reward_model")
# methods whose trainers are wired into the worker; the others answer a clear 400 until they are
RUNNABLE_METHODS: tuple[str, ...] = METHOD_TYPES
RL_METHODS: tuple[str, ...] = ("reinforcement", "grpo", "ppo")

# Peak learning rates that `learning_rate_multiplier` scales, (LoRA, full fine-tuning): full
# fine-tuning moves every weight, and preference/RL objectives diverge at SFT's rates.
BASE_LEARNING_RATES: dict[str, tuple[float, float]] = {
    "supervised": (2e-4, 2e-5),
    "dpo": (5e-5, 5e-6),
    "reward_model": (1e-4, 1e-5),
    "grpo": (1e-5, 1e-6),
    "reinforcement": (1e-5, 1e-6),
    "ppo": (1e-5, 1e-6),
}


# the hyperparameters that take "auto" (OpenAI's); mixed_precision's "auto" is a runtime choice
AUTO_FIELDS = ("n_epochs", "batch_size", "learning_rate_multiplier", "beta")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CommonHyperparameters(_Strict):
    """What every method takes. OpenAI's three knobs, then ours."""

    n_epochs: Annotated[int, Field(ge=1, le=100)] | Auto = "auto"
    batch_size: Annotated[int, Field(ge=1, le=1024)] | Auto = "auto"
    learning_rate_multiplier: Annotated[float, Field(gt=0, le=100)] | Auto = "auto"
    # the adapter
    lora: bool = True
    lora_r: Annotated[int, Field(ge=1, le=1024)] = 8
    lora_alpha: Annotated[int, Field(ge=1, le=4096)] = 16
    lora_dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    lora_target_modules: list[str] | None = None
    # optimisation
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


class _TextHyperparameters(CommonHyperparameters):
    """Methods that train on given text (not on rollouts): sequences are truncated to `max_length`."""

    max_length: Annotated[int, Field(ge=8, le=131072)] = 1024


class SupervisedHyperparameters(_TextHyperparameters):
    packing: bool = False


class DpoHyperparameters(_TextHyperparameters):
    beta: Annotated[float, Field(gt=0, le=10)] | Auto = "auto"
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    label_smoothing: Annotated[float, Field(ge=0, lt=0.5)] = 0.0
    precompute_ref_log_probs: bool = False
    max_prompt_length: Annotated[int, Field(ge=1)] | None = None


class RewardModelHyperparameters(_TextHyperparameters):
    max_prompt_length: Annotated[int, Field(ge=1)] | None = None


class _RLHyperparameters(CommonHyperparameters):
    """Rollouts: prompts per step is `batch_size`."""

    max_prompt_length: Annotated[int, Field(ge=1, le=131072)] = 512
    max_completion_length: Annotated[int, Field(ge=1, le=32768)] = 64
    temperature: Annotated[float, Field(gt=0, le=10)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0


class GrpoHyperparameters(_RLHyperparameters):
    num_generations: Annotated[int, Field(ge=2, le=256)] = 4
    beta: Annotated[float, Field(ge=0, le=10)] = 0.0  # KL to the reference (k3); 0 = no reference pass
    epsilon: Annotated[float, Field(gt=0, lt=1)] = 0.2
    epsilon_high: Annotated[float, Field(gt=0, lt=10)] | None = None
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = "grpo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    num_iterations: Annotated[int, Field(ge=1, le=64)] = 1
    mask_truncated_completions: bool = False


class PpoHyperparameters(_RLHyperparameters):
    num_ppo_epochs: Annotated[int, Field(ge=1, le=64)] = 4
    num_mini_batches: Annotated[int, Field(ge=1, le=1024)] = 1
    kl_coef: Annotated[float, Field(ge=0, le=10)] = 0.05
    gamma: Annotated[float, Field(gt=0, le=1)] = 1.0
    lam: Annotated[float, Field(ge=0, le=1)] = 0.95
    cliprange: Annotated[float, Field(gt=0, lt=1)] = 0.2
    cliprange_value: Annotated[float, Field(gt=0)] = 0.2
    vf_coef: Annotated[float, Field(ge=0)] = 0.1
    whiten_advantages: bool = True
    missing_eos_penalty: float | None = None


class SupervisedMethod(_Strict):
    hyperparameters: SupervisedHyperparameters = Field(default_factory=SupervisedHyperparameters)


class DpoMethod(_Strict):
    hyperparameters: DpoHyperparameters = Field(default_factory=DpoHyperparameters)


class RewardModelMethod(_Strict):
    hyperparameters: RewardModelHyperparameters = Field(default_factory=RewardModelHyperparameters)


class GrpoMethod(_Strict):
    """GRPO; also OpenAI's `reinforcement` method, which runs GRPO with its grader."""

    grader: Grader
    hyperparameters: GrpoHyperparameters = Field(default_factory=GrpoHyperparameters)


class PpoMethod(_Strict):
    """PPO; for a reward model, use a `score_model` grader naming a `reward_model` job's model."""

    grader: Grader
    hyperparameters: PpoHyperparameters = Field(default_factory=PpoHyperparameters)


_BODIES: dict[str, type[BaseModel]] = {
    "supervised": SupervisedMethod,
    "dpo": DpoMethod,
    "reward_model": RewardModelMethod,
}


class Method(_Strict):
    type: MethodType
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None
    reward_model: RewardModelMethod | None = None
    reinforcement: GrpoMethod | None = None
    grpo: GrpoMethod | None = None
    ppo: PpoMethod | None = None

    @model_validator(mode="after")
    def _one_body(self) -> Method:
        for other in METHOD_TYPES:
            if other != self.type and getattr(self, other) is not None:
                raise ValueError(f"method.{other} given but method.type is '{self.type}'")
        if getattr(self, self.type) is None:
            if self.type not in _BODIES:
                raise ValueError(f"method.{self.type} with a 'grader' is required for method '{self.type}'")
            setattr(self, self.type, _BODIES[self.type]())
        return self

    @property
    def grader(self) -> BaseModel | None:
        return getattr(getattr(self, self.type), "grader", None)

    @property
    def hyperparameters(self) -> CommonHyperparameters:
        body = getattr(self, self.type)
        hp = getattr(body, "hyperparameters", None)
        if not isinstance(hp, CommonHyperparameters):
            raise ValueError(f"method '{self.type}' has no typed hyperparameters")
        return hp


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


def resolve_hyperparameters(method: Method, *, n_examples: int) -> None:
    """Replace every "auto" in the method's hyperparameters with a number chosen from the dataset size."""
    hp = method.hyperparameters
    # batch: 1/8 of the data, between 1 and 8 — small sets still get several steps per epoch
    if hp.batch_size == "auto":
        hp.batch_size = max(1, min(8, n_examples // 8))
    # epochs: aim for ~256 example-passes on small sets, never fewer than 1 or more than 10
    if hp.n_epochs == "auto":
        hp.n_epochs = max(1, min(10, math.ceil(256 / max(1, n_examples))))
    if hp.learning_rate_multiplier == "auto":
        hp.learning_rate_multiplier = 1.0
    if isinstance(hp, DpoHyperparameters) and hp.beta == "auto":
        hp.beta = 0.1  # the DPO paper's default


def learning_rate(method: Method) -> float:
    hp = method.hyperparameters
    if hp.learning_rate is not None:
        return hp.learning_rate
    if hp.learning_rate_multiplier == "auto":
        raise ValueError("hyperparameters must be resolved first")
    lora_lr, full_lr = BASE_LEARNING_RATES[method.type]
    return (lora_lr if hp.lora else full_lr) * hp.learning_rate_multiplier


def trainer_fields(method: Method) -> dict[str, Any]:
    """Resolved hyperparameters under the trainers' config field names."""
    hp = method.hyperparameters.model_dump()
    if any(hp.get(name) == "auto" for name in AUTO_FIELDS):
        raise ValueError("hyperparameters must be resolved first")
    hp["use_lora"] = hp.pop("lora")
    hp["learning_rate"] = learning_rate(method)
    hp.pop("learning_rate_multiplier")
    return hp


def stored_method(method: Method) -> dict[str, Any]:
    return method.model_dump(mode="json", exclude_none=True)


def load_method(data: dict[str, Any]) -> Method:
    return Method.model_validate(data)
