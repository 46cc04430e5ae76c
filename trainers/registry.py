"""The method registry: what each post-training method is, declared once.

**Adding a method = one trainer module + one entry here.** The trainer module (``trainers/foo.py``)
holds a config dataclass (a ``trainers.core.config.TrainingConfig`` whose ``method`` names the entry) and a
train function with the one entry-point signature (``trainers.families.entry.TrainEntry``):

    train_foo(config, train_rows, valid_rows=None, callbacks=None, *, rewards=None) -> TrainResult

The entry here (a ``Method``) declares, for everyone else:

- ``name``: the job's ``method.type``; ``summary``: what runs (the README's methods table);
- ``formats``: the training-file formats it accepts (``trainers.formats.FileFormat`` values);
- ``hyperparameters``: every knob with its type, default, range and doc, declared here only. This is the
  single source of the API's validation (``service/jobs/spec.py`` builds its pydantic models from it),
  of the trainer configs' fields (each is ``trainers.core.config.knob(method, name)``: default and help
  read from here) and of their range checks (``TrainingConfig.validate`` reads it); ``constraints`` are
  the checks that involve several fields;
- ``learning_rates``: the peak rates (LoRA, full fine-tuning) that ``learning_rate_multiplier`` scales;
- ``grader``: whether the method takes an RL grader (then the worker passes a
``trainers.rewards.reward_set.RewardSet``);
- ``metrics``: the per-step metric names it emits beyond the loop's own (the stream, dashboard, docs);
- ``reference``: whether, and with which knobs, it holds a frozen reference policy (a ``ReferenceUse``;
  the pre-flight estimate counts its memory, the rollout configs' ``uses_reference`` read it);
- ``trainer`` and ``config``: import paths ``"module:attribute"``, resolved by the worker
  (``resolve``), never imported here.

Where it lives, and why: the service must read this without importing torch, and DESIGN.md's import
rules say trainers import nothing of ours and the service nothing of the worker. The declarations are
about the trainers (their configs check against them, and ``trainers`` stays usable on its own), so they
live in ``trainers/``, in a module that imports only the standard library and ``trainers.formats`` (the
file formats, declared once). The service may import these, ``trainers.rewards.graders`` and
``trainers.rewards.formula`` — and nothing else of ``trainers`` (``make lint``'s import contracts;
``tests/trainers/test_registry.py`` checks they stay torch-free). That test also fails if a method is
declared here but not wired elsewhere: every entry point and config resolves, every config field is
built from its declaration, every format is one the upload validator detects, every metric is emitted
by a one-step run.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from trainers.formats import SFT_FORMATS, FileFormat

__all__ = [
    "AUTO",
    "LOOP_METRICS",
    "METHODS",
    "Constraint",
    "Hyperparameter",
    "Method",
    "ReferenceUse",
    "choices",
    "get_method",
    "resolve",
]

AUTO = "auto"
# a run has fewer optimizer steps than this (the service keeps steps in 32-bit columns)
MAX_STEPS = 2**31 - 1
"""OpenAI's "pick for me" value, accepted by the hyperparameters marked ``auto`` and resolved at job
creation (``service.jobs.spec.resolve_hyperparameters``); trainers never see it."""

Kind = Literal["int", "float", "bool", "str", "str_list"]


@dataclass(frozen=True)
class Hyperparameter:
    """One knob: its API name, type, default, range and the doc line shown in the README.

    ``ge``/``gt``/``le``/``lt`` bound numbers; ``choices`` lists a string's values; ``nullable`` allows
    ``None`` (the doc says what it means); ``auto`` allows ``"auto"`` at the API (then ``default`` is
    ``"auto"``). ``trainer_name`` is the config field's name when it differs (``lora`` -> ``use_lora``);
    ``in_trainer=False`` marks API-only knobs (``learning_rate_multiplier`` becomes ``learning_rate``).
    ``auto_value`` is what ``"auto"`` resolves to, unless the service derives it from the data size.
    """

    name: str
    kind: Kind
    default: Any
    doc: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] | None = None
    nullable: bool = False
    auto: bool = False
    trainer_name: str | None = None
    in_trainer: bool = True
    auto_value: Any = None

    @property
    def field(self) -> str:
        """The trainer config's field name."""
        return self.trainer_name or self.name

    def accepts(self, value: Any) -> bool:
        """Whether a trainer config may hold ``value`` (``"auto"`` is never accepted: it is resolved).

        >>> Hyperparameter("epsilon", "float", 0.2, "", gt=0, lt=1).accepts(0.0)
        False
        >>> Hyperparameter("lora_r", "int", 8, "", ge=1).accepts(True)
        False
        """
        if value is None:
            return self.nullable
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "str":
            return isinstance(value, str) and (self.choices is None or value in self.choices)
        if self.kind == "str_list":
            return isinstance(value, list) and all(isinstance(v, str) for v in value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.kind == "int" and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def describe(self) -> str:
        """The accepted values in words, for docs and error messages.

        >>> Hyperparameter("top_p", "float", 1.0, "", gt=0, le=1).describe()
        'float in (0, 1]'
        """
        if self.kind == "str" and self.choices:
            text = (
                ", ".join(self.choices[:-1]) + " or " + self.choices[-1]
                if len(self.choices) > 1
                else self.choices[0]
            )
        elif self.kind in ("int", "float"):
            low = (
                f"[{self.ge:g}"
                if self.ge is not None
                else f"({self.gt:g}"
                if self.gt is not None
                else "(-inf"
            )
            high = (
                f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else "inf)"
            )
            text = f"{self.kind} in {low}, {high}"
        else:
            text = "list of strings" if self.kind == "str_list" else self.kind
        if self.auto:
            text += ' or "auto"'
        if self.nullable:
            text += " or null"
        return text


@dataclass(frozen=True)
class Constraint:
    """A check over several resolved hyperparameters; ``param`` is the one the error names."""

    param: str
    holds: Callable[[Mapping[str, Any]], bool]
    message: str


def _quantized_with_lora(hp: Mapping[str, Any]) -> bool:
    return hp.get("quantization") is None or bool(hp.get("lora", True))


SHARED_CONSTRAINTS: tuple[Constraint, ...] = (
    Constraint(
        "quantization",
        _quantized_with_lora,
        "needs lora: true (a quantized base stays frozen; only a LoRA adapter beside it trains)",
    ),
)
"""The checks over ``COMMON`` knobs every method declares: each method's ``constraints`` start with them."""


@dataclass(frozen=True)
class ReferenceUse:
    """How a method compares its policy with a frozen reference (the model it started from): a full-weight
    job holds a second copy of the weights for it, a LoRA job disables its adapter instead. ``kl_knob``:
    the coefficient whose 0 skips the reference pass; ``precomputed_knob``: the bool that computes the
    reference log-probs once before training, so that none is held while it trains.

    >>> ReferenceUse(kl_knob="beta").needed({"beta": 0.0})
    False
    """

    kl_knob: str | None = None
    precomputed_knob: str | None = None

    def needed(self, hp: Mapping[str, Any]) -> bool:
        """Whether a run with the resolved hyperparameters ``hp`` (API names) holds a reference."""
        if self.precomputed_knob is not None and hp.get(self.precomputed_knob):
            return False
        return self.kl_knob is None or bool(hp.get(self.kl_knob))


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    formats: tuple[str, ...]
    hyperparameters: tuple[Hyperparameter, ...]
    learning_rates: tuple[float, float]  # (LoRA, full fine-tuning), scaled by learning_rate_multiplier
    trainer: str  # "module:function" with the TrainEntry signature
    config: str  # "module:Class", a TrainingConfig subclass
    metrics: tuple[str, ...]  # per-step metrics beyond the loop's; "{grader}" stands for each grader name
    grader: bool = False
    constraints: tuple[Constraint, ...] = SHARED_CONSTRAINTS
    # valid_* keys beyond valid_loss (every loss metric, prefixed); grader methods: RL_EVAL_METRICS, no loss
    eval_metrics: tuple[str, ...] = ()
    # None: the method has no reference policy (SFT, reward model, ORPO, CPO, SimPO)
    reference: ReferenceUse | None = None
    # trains on rows with images, on a vision base (docs/vision.md); its hyperparameters include VISION
    images: bool = False

    def uses_reference(self, hp: Mapping[str, Any]) -> bool:
        """Whether a run with the resolved hyperparameters ``hp`` (API names) holds a reference policy
        (``trainers.memory_model`` counts its memory, the RL configs load it)."""
        return self.reference is not None and self.reference.needed(hp)

    def hyperparameter(self, name: str) -> Hyperparameter:
        for p in self.hyperparameters:
            if p.name == name:
                return p
        raise KeyError(name)

    def check(self, values: Mapping[str, Any], *, by_field: bool = False) -> tuple[str, str] | None:
        """The first (name, message) that ``values`` break, in declaration order, or None.

        ``values`` map API names (or config field names with ``by_field``) to resolved values; absent
        names are not checked. Constraints run once every single value is in range.
        """
        for p in self.hyperparameters:
            key = p.field if by_field else p.name
            if (not by_field or p.in_trainer) and key in values and not p.accepts(values[key]):
                return p.name, f"{p.name}={values[key]!r} is out of range: expected {p.describe()}"
        named = {
            p.name: values[k]
            for p in self.hyperparameters
            if (k := p.field if by_field else p.name) in values
        }
        for c in self.constraints:
            if not c.holds(named):
                return c.param, f"{c.param}={named.get(c.param)!r}: {c.message}"
        return None


def resolve(path: str) -> Any:
    """The object an import path ``"package.module:attribute"`` names (imports the module)."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


# -- the hyperparameters ---------------------------------------------------------------------------------
def _p(name: str, kind: Kind, default: Any, doc: str, **kw: Any) -> Hyperparameter:
    return Hyperparameter(name, kind, default, doc, **kw)


COMMON: tuple[Hyperparameter, ...] = (
    _p("n_epochs", "int", AUTO, "passes over the training file", ge=1, le=100, auto=True),
    _p("batch_size", "int", AUTO, "examples per micro-batch (RL: prompts)", ge=1, le=1024, auto=True),
    _p(
        "learning_rate_multiplier",
        "float",
        AUTO,
        "scales the method's base learning rate",
        gt=0,
        le=100,
        auto=True,
        in_trainer=False,
        auto_value=1.0,
    ),
    _p(
        "lora",
        "bool",
        True,
        "train a LoRA adapter (merged at the end) instead of every weight",
        trainer_name="use_lora",
    ),
    _p(
        "quantization",
        "str",
        None,
        "the frozen base in 4-bit NF4 with double quantization (QLoRA) or 8-bit LLM.int8, through "
        "bitsandbytes; the adapter trains in full precision and the download merges it into the "
        "dequantized base; needs lora; null: the base unquantized",
        choices=("nf4", "int8"),
        nullable=True,
    ),
    _p("lora_r", "int", 8, "LoRA rank", ge=1, le=1024),
    _p("lora_alpha", "int", 16, "LoRA scaling numerator (scale = alpha / r)", ge=1, le=4096),
    _p("lora_dropout", "float", 0.0, "LoRA dropout", ge=0, lt=1),
    _p(
        "lora_target_modules",
        "str_list",
        None,
        "modules to adapt; null: every linear layer but the head",
        nullable=True,
    ),
    _p(
        "learning_rate",
        "float",
        None,
        "absolute peak learning rate; overrides the multiplier",
        gt=0,
        le=1,
        nullable=True,
    ),
    _p("gradient_accumulation_steps", "int", 1, "micro-batches per optimizer step", ge=1, le=1024),
    _p("lr_scheduler", "str", "linear", "decay after warmup", choices=("linear", "cosine", "constant")),
    _p("warmup_ratio", "float", 0.0, "fraction of the steps spent warming up", ge=0, le=1),
    _p("weight_decay", "float", 0.0, "AdamW decoupled weight decay", ge=0, le=1),
    _p("max_grad_norm", "float", 1.0, "clip the global gradient norm to this", gt=0),
    _p(
        "mixed_precision",
        "str",
        "auto",
        "compute precision; auto: bf16 on capable GPUs, fp32 on CPUs; bf16 on a CPU autocasts too (faster "
        "where the CPU has AVX512-BF16 or AMX); fp16 on a CPU trains in fp32",
        choices=("auto", "no", "bf16", "fp16"),
    ),
    _p("gradient_checkpointing", "bool", False, "recompute each layer in backward: least memory, slower"),
    _p(
        "max_steps",
        "int",
        None,
        "cap on optimizer steps; null: n_epochs full epochs",
        ge=1,
        le=MAX_STEPS,
        nullable=True,
    ),
    _p(
        "save_steps",
        "int",
        0,
        "resumable checkpoint every N steps; 0: none by step count",
        ge=0,
        le=MAX_STEPS,
    ),
    _p(
        "save_minutes",
        "float",
        None,
        "resumable checkpoint at least every N minutes of training; 0: none by time; "
        "null: the deployment's default (TUNEHOUSE_CHECKPOINT_MINUTES, 10)",
        ge=0,
        le=10080,
        nullable=True,
    ),
    _p(
        "eval_steps",
        "int",
        0,
        "validation (RL: the grader on the validation prompts) every N steps and at the end; "
        "0: each epoch end",
        ge=0,
        le=MAX_STEPS,
    ),
)

_MAX_LENGTH = _p("max_length", "int", 1024, "sequences are truncated to this many tokens", ge=8, le=131072)
_MAX_PROMPT_CUT = _p(
    "max_prompt_length",
    "int",
    None,
    "prompts keep their last this many tokens; null: not cut",
    ge=1,
    le=131072,
    nullable=True,
)

VISION: tuple[Hyperparameter, ...] = (
    _p(
        "train_vision_tower",
        "bool",
        False,
        "vision bases (docs/vision.md): train the vision tower too (LoRA on its linear layers, or every "
        "weight of it without lora); false: frozen",
    ),
    _p(
        "train_projector",
        "bool",
        False,
        "vision bases: train the projector from the vision tower into the language model (every weight "
        "of it, with or without lora); false: frozen",
    ),
)
"""The knobs of the methods that train on images (``Method.images``): what of a vision base trains
beside its language model (``trainers.modalities``)."""

RL_COMMON: tuple[Hyperparameter, ...] = (
    _p("max_prompt_length", "int", 512, "prompts keep their last this many tokens", ge=1, le=131072),
    _p("max_completion_length", "int", 64, "sampling budget in tokens", ge=1, le=32768),
    _p("temperature", "float", 1.0, "sampling temperature (log-probs use the same)", gt=0, le=10),
    _p("top_p", "float", 1.0, "nucleus sampling", gt=0, le=1),
    _p(
        "eval_sampling",
        "str",
        "greedy",
        "validation completions: greedy, or sampled with temperature and top_p",
        choices=("greedy", "sample"),
    ),
)

# knobs several RL methods share
_NUM_GENERATIONS = _p("num_generations", "int", 4, "completions sampled per prompt (G, k)", ge=2, le=256)
_EPSILON = _p("epsilon", "float", 0.2, "ratio clip: [1 - epsilon, 1 + epsilon_high]", gt=0, lt=1)
_EPSILON_HIGH = _p(
    "epsilon_high",
    "float",
    None,
    "upper clip (DAPO's clip-higher); null: epsilon",
    gt=0,
    lt=10,
    nullable=True,
)
_NUM_ITERATIONS = _p("num_iterations", "int", 1, "optimizer steps per rollout (μ)", ge=1, le=64)
_MASK_TRUNCATED = _p("mask_truncated_completions", "bool", False, "completions without EOS get no loss")
_MISSING_EOS_PENALTY = _p(
    "missing_eos_penalty",
    "float",
    None,
    "subtracted from the score of completions without EOS",
    nullable=True,
)

SUPERVISED_FORMATS = tuple(sorted(SFT_FORMATS))
PREFERENCE_FORMATS = (FileFormat.PREFERENCE,)
RL_FORMATS = (FileFormat.PROMPT_ONLY,)

LOOP_METRICS = ("loss", "learning_rate", "grad_norm", "tokens_per_second", "trained_tokens")
"""What the shared loop (``trainers.core.loop``) reports every step for every method, besides ``step``,
``epoch`` and ``total_steps``; an eval row has ``valid_loss`` and the method's ``eval_metrics`` (a
grader method's eval row has no loss: its ``eval_metrics`` are the grader's scores, ``RL_EVAL_METRICS``)."""

# the grader-derived metric of RL methods; "{grader}" is replaced by each grader's name
REWARD_METRICS = ("rewards/{grader}/mean", "rewards/{grader}/unscored")
# what an RL method's validation pass reports (trainers.families.rl.reward_evaluator): the mean weighted
# reward of
# the validation prompts' completions, and each grader's mean; "{grader}" as above
RL_EVAL_METRICS = ("valid_reward", "valid_reward/{grader}")

OPENAI_CHECKPOINT_METRICS = {
    "loss": "train_loss",
    "mean_token_accuracy": "train_mean_token_accuracy",
    "valid_loss": "valid_loss",
    "valid_mean_token_accuracy": "valid_mean_token_accuracy",
}
"""The metrics OpenAI's checkpoint objects carry (``fine_tuning.job.checkpoint``'s ``metrics``), from our
step rows' names (``LOOP_METRICS``, SFT's ``metrics`` and ``eval_metrics``)."""
OPENAI_CHECKPOINT_PREFIXES = (RL_EVAL_METRICS[0],)
"""Metric names a checkpoint keeps as they are: an RL validation pass's ``RL_EVAL_METRICS``."""
COMPLETION_METRICS = (
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
)

SUPERVISED = Method(
    name="supervised",
    summary="SFT: cross-entropy on the target tokens; optional packing",
    formats=SUPERVISED_FORMATS,
    hyperparameters=(
        *COMMON,
        _MAX_LENGTH,
        *VISION,
        _p(
            "packing",
            "bool",
            False,
            "bin each micro-batch into rows of max_length (best-fit decreasing), each example "
            "attending only to itself (on CUDA with bf16/fp16, through flash attention's variable-length "
            "kernel); without it, the architectures whose decoder runs alone still drop the padding (rows "
            "no wider than the micro-batch's longest example), as the preference methods always do; "
            "refused where the architecture cannot take packed rows (docs/model-families.md)",
        ),
    ),
    # full fine-tuning moves every weight: a tenth of the adapter's rate
    learning_rates=(2e-4, 2e-5),
    trainer="trainers.methods.sft:train_sft",
    config="trainers.methods.sft:SFTConfig",
    metrics=("mean_token_accuracy",),
    eval_metrics=("valid_mean_token_accuracy",),
    images=True,
)

DPO = Method(
    name="dpo",
    summary="DPO and its `loss_type` variants; the reference is the adapter-disabled base or a frozen copy",
    formats=PREFERENCE_FORMATS,
    hyperparameters=(
        *COMMON,
        _MAX_LENGTH,
        *VISION,
        _MAX_PROMPT_CUT,
        _p(
            "beta",
            "float",
            AUTO,
            "strength of the implicit KL to the reference",
            gt=0,
            le=10,
            auto=True,
            auto_value=0.1,
        ),  # the DPO paper's
        _p("loss_type", "str", "sigmoid", "DPO, IPO or SLiC's hinge", choices=("sigmoid", "ipo", "hinge")),
        _p("label_smoothing", "float", 0.0, "conservative DPO's flip probability", ge=0, lt=0.5),
        _p(
            "precompute_ref_log_probs",
            "bool",
            False,
            (
                "reference log-probs once, then none in memory; kept with the training file, so a later job "
                "on it with the same model and precision skips them"
            ),
        ),
    ),
    # preference objectives diverge at SFT's rates
    learning_rates=(5e-5, 5e-6),
    trainer="trainers.methods.dpo:train_dpo",
    config="trainers.methods.dpo:DPOConfig",
    metrics=(
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ),
    eval_metrics=(
        "valid_rewards/chosen",
        "valid_rewards/rejected",
        "valid_rewards/accuracies",
        "valid_rewards/margins",
        "valid_logps/chosen",
        "valid_logps/rejected",
    ),
    reference=ReferenceUse(precomputed_knob="precompute_ref_log_probs"),
    images=True,
)

REWARD_MODEL = Method(
    name="reward_model",
    summary="scalar head, Bradley–Terry loss; usable by `score_model` graders",
    formats=PREFERENCE_FORMATS,
    hyperparameters=(*COMMON, _MAX_LENGTH, _MAX_PROMPT_CUT),
    learning_rates=(1e-4, 1e-5),
    trainer="trainers.methods.reward_model:train_reward_model",
    config="trainers.methods.reward_model:RewardModelConfig",
    metrics=("accuracy", "rewards/chosen", "rewards/rejected", "rewards/margins"),
    eval_metrics=(
        "valid_accuracy",
        "valid_rewards/chosen",
        "valid_rewards/rejected",
        "valid_rewards/margins",
    ),
)

_PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "nll_loss",
)
_PAIR_KNOBS = (*COMMON, _MAX_LENGTH, _MAX_PROMPT_CUT)
_LABEL_SMOOTHING = _p(
    "label_smoothing",
    "float",
    0.0,
    "probability that a pair's labels are flipped (sigmoid, simpo)",
    ge=0,
    lt=0.5,
)


def _valid(metrics: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"valid_{name}" for name in metrics)


_ORPO_METRICS = (*_PAIR_METRICS, "log_odds_ratio", "log_odds_chosen")
ORPO = Method(
    name="orpo",
    summary="ORPO: SFT on the chosen answer + β · odds-ratio penalty on the rejected one; no reference model",
    formats=PREFERENCE_FORMATS,
    hyperparameters=(
        *_PAIR_KNOBS,
        _p("beta", "float", 0.1, "weight of the odds-ratio term (the paper's λ)", gt=0, le=10),
    ),
    # ORPO is also SFT: DPO's rates
    learning_rates=(5e-5, 5e-6),
    trainer="trainers.methods.orpo:train_orpo",
    config="trainers.methods.orpo:ORPOConfig",
    metrics=_ORPO_METRICS,
    eval_metrics=_valid(_ORPO_METRICS),
)

CPO = Method(
    name="cpo",
    summary="CPO: DPO-style loss without a reference (sigmoid / hinge / ipo / simpo) + α · chosen NLL",
    formats=PREFERENCE_FORMATS,
    hyperparameters=(
        *_PAIR_KNOBS,
        _p("beta", "float", 0.1, "temperature of the preference term", gt=0, le=10),
        _p(
            "loss_type",
            "str",
            "sigmoid",
            "CPO, SLiC's hinge, IPO or SimPO (ipo and simpo on per-token mean log-probs)",
            choices=("sigmoid", "hinge", "ipo", "simpo"),
        ),
        _p("cpo_alpha", "float", 1.0, "weight of the chosen answer's NLL", ge=0, le=10),
        _p("simpo_gamma", "float", 0.5, "SimPO's target reward margin γ (loss_type simpo)", ge=0, le=10),
        _LABEL_SMOOTHING,
    ),
    learning_rates=(5e-5, 5e-6),
    trainer="trainers.methods.cpo:train_cpo",
    config="trainers.methods.cpo:CPOConfig",
    metrics=_PAIR_METRICS,
    eval_metrics=_valid(_PAIR_METRICS),
)

SIMPO = Method(
    name="simpo",
    summary="SimPO: -log σ(β · mean log-prob margin - γ), length-normalised, no reference model",
    formats=PREFERENCE_FORMATS,
    hyperparameters=(
        *_PAIR_KNOBS,
        _p("beta", "float", 2.0, "reward scale β (the authors use 2 to 2.5)", gt=0, le=100),
        _p("simpo_gamma", "float", 1.0, "target reward margin γ (γ/β = 0.5 by default)", ge=0, le=100),
        _p("cpo_alpha", "float", 0.0, "weight of an NLL term on the chosen answer (CPO-SimPO)", ge=0, le=10),
        _LABEL_SMOOTHING,
    ),
    # the SimPO authors train ~10x lower than DPO (3e-7 to 1e-6, full fine-tuning)
    learning_rates=(1e-5, 1e-6),
    trainer="trainers.methods.cpo:train_simpo",
    config="trainers.methods.cpo:SimPOConfig",
    metrics=_PAIR_METRICS,
    eval_metrics=_valid(_PAIR_METRICS),
)

_KTO_METRICS = ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
KTO = Method(
    name="kto",
    summary="KTO on labelled completions (a preference pair gives a desirable and an undesirable one): "
    "desirable/undesirable weights, KL reference point from mismatched pairs of the micro-batch; the "
    "reference as for `dpo`",
    # preference pairs are unpaired: the chosen completion desirable, the rejected one undesirable
    formats=(FileFormat.UNPAIRED_PREFERENCE, FileFormat.PREFERENCE),
    hyperparameters=(
        # the KL estimate pairs each example with another one of its micro-batch
        *(
            replace(p, ge=2, doc="examples per micro-batch, at least 2") if p.name == "batch_size" else p
            for p in COMMON
        ),
        _MAX_LENGTH,
        _MAX_PROMPT_CUT,
        _p("beta", "float", 0.1, "strength of the implicit KL to the reference", gt=0, le=10),
        _p("desirable_weight", "float", 1.0, "λ_D, weight of the desirable examples' loss", gt=0, le=100),
        _p("undesirable_weight", "float", 1.0, "λ_U, weight of the undesirable examples' loss", gt=0, le=100),
    ),
    learning_rates=(5e-5, 5e-6),
    trainer="trainers.methods.kto:train_kto",
    config="trainers.methods.kto:KTOConfig",
    # chosen/rejected: averaged over the desirable/undesirable examples; absent from a step without any
    metrics=_KTO_METRICS,
    eval_metrics=_valid(_KTO_METRICS),
    reference=ReferenceUse(),
)

GRPO = Method(
    name="grpo",
    summary="GRPO with the job's `grader` (loss grpo / dr_grpo / dapo)",
    formats=RL_FORMATS,
    hyperparameters=(
        *COMMON,
        *RL_COMMON,
        _NUM_GENERATIONS,
        _p("beta", "float", 0.0, "KL to the reference (k3); 0: no reference pass", ge=0, le=10),
        _EPSILON,
        _EPSILON_HIGH,
        _p(
            "loss_type",
            "str",
            "grpo",
            "token-loss normalisation (see trainers/losses/rl.py)",
            choices=("grpo", "dr_grpo", "dapo"),
        ),
        _p(
            "scale_rewards",
            "str",
            "group",
            "advantage divided by the reward std of",
            choices=("group", "batch", "none"),
        ),
        _NUM_ITERATIONS,
        _MASK_TRUNCATED,
    ),
    # RL moves the policy on its own samples: small steps
    learning_rates=(1e-5, 1e-6),
    trainer="trainers.methods.grpo:train_grpo",
    config="trainers.methods.grpo:GRPOConfig",
    metrics=(
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        *COMPLETION_METRICS,
        *REWARD_METRICS,
        "clip_ratio",
        "entropy",
        "kl",
    ),
    grader=True,
    eval_metrics=RL_EVAL_METRICS,
    reference=ReferenceUse(kl_knob="beta"),
)


def _divides_rollout(hp: Mapping[str, Any]) -> bool:
    rollout = hp.get("batch_size", 1) * hp.get("gradient_accumulation_steps", 1)
    return bool(rollout % hp.get("num_mini_batches", 1) == 0)


PPO = Method(
    name="ppo",
    summary="PPO with a value head, per-token KL, GAE; reward from the `grader`",
    formats=RL_FORMATS,
    hyperparameters=(
        *COMMON,
        *RL_COMMON,
        _p("num_ppo_epochs", "int", 4, "passes over each rollout", ge=1, le=64),
        _p("num_mini_batches", "int", 1, "optimizer steps per pass", ge=1, le=1024),
        _p("kl_coef", "float", 0.05, "per-token KL penalty to the reference", ge=0, le=10),
        _p("gamma", "float", 1.0, "GAE discount", ge=0, le=1),
        _p("lam", "float", 0.95, "GAE λ", ge=0, le=1),
        _p("cliprange", "float", 0.2, "policy ratio clip", gt=0, lt=1),
        _p("cliprange_value", "float", 0.2, "value clip around the rollout's values", gt=0),
        _p("vf_coef", "float", 0.1, "weight of the value loss", ge=0),
        _p("whiten_advantages", "bool", True, "advantages to mean 0, std 1 per rollout"),
        _MISSING_EOS_PENALTY,
    ),
    constraints=(
        *SHARED_CONSTRAINTS,
        Constraint(
            "num_mini_batches",
            _divides_rollout,
            "must divide the rollout's prompts, batch_size * gradient_accumulation_steps",
        ),
    ),
    learning_rates=(1e-5, 1e-6),
    trainer="trainers.methods.ppo:train_ppo",
    config="trainers.methods.ppo:PPOConfig",
    metrics=(
        "score",
        "kl",
        "returns",
        *COMPLETION_METRICS,
        *REWARD_METRICS,
        "policy_loss",
        "value_loss",
        "approx_kl",
        "clip_fraction",
        "entropy",
    ),
    grader=True,
    eval_metrics=RL_EVAL_METRICS,
    reference=ReferenceUse(kl_knob="kl_coef"),
)

RLOO = Method(
    name="rloo",
    summary="REINFORCE with a leave-one-out baseline over k samples per prompt; KL penalty in the reward",
    formats=RL_FORMATS,
    hyperparameters=(
        *COMMON,
        *RL_COMMON,
        _NUM_GENERATIONS,
        _p(
            "beta",
            "float",
            0.05,
            "KL penalty in the reward (summed log-ratio to the reference); 0: no reference pass",
            ge=0,
            le=10,
        ),
        _EPSILON,
        _EPSILON_HIGH,
        _NUM_ITERATIONS,
        _p("normalize_advantages", "bool", False, "advantages to mean 0, std 1 per step"),
        _MASK_TRUNCATED,
    ),
    learning_rates=(1e-5, 1e-6),  # as GRPO: the policy moves on its own samples
    trainer="trainers.methods.rloo:train_rloo",
    config="trainers.methods.rloo:RLOOConfig",
    metrics=(
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        *COMPLETION_METRICS,
        *REWARD_METRICS,
        "clip_ratio",
        "entropy",
        "kl",
    ),
    grader=True,
    eval_metrics=RL_EVAL_METRICS,
    reference=ReferenceUse(kl_knob="beta"),
)

ONLINE_DPO = Method(
    name="online_dpo",
    summary="two samples per prompt, the `grader` (a `score_model`: a reward model) picks the preferred "
    "one; DPO loss on the judged pair",
    formats=RL_FORMATS,
    hyperparameters=(
        *COMMON,
        *(p for p in RL_COMMON if p.name != "temperature"),
        _p("temperature", "float", 1.0, "sampling temperature (the DPO log-probs use 1)", gt=0, le=10),
        _p("beta", "float", 0.1, "strength of the implicit KL to the reference", gt=0, le=10),
        _p("loss_type", "str", "sigmoid", "DPO or IPO on the judged pair", choices=("sigmoid", "ipo")),
        _MISSING_EOS_PENALTY,
    ),
    learning_rates=(5e-5, 5e-6),  # DPO's
    trainer="trainers.methods.online_dpo:train_online_dpo",
    config="trainers.methods.online_dpo:OnlineDPOConfig",
    metrics=(
        "reward",
        "frac_pairs_judged",
        "scores_margin",
        *COMPLETION_METRICS,
        *REWARD_METRICS,
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ),
    grader=True,
    eval_metrics=RL_EVAL_METRICS,
    reference=ReferenceUse(),  # DPO's log-ratios are to the reference
)

# OpenAI's `reinforcement` is GRPO under OpenAI's name
REINFORCEMENT = replace(GRPO, name="reinforcement", summary="GRPO with the job's `grader` (OpenAI's name)")

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        SUPERVISED,
        DPO,
        ORPO,
        CPO,
        SIMPO,
        KTO,
        REWARD_MODEL,
        REINFORCEMENT,
        GRPO,
        PPO,
        RLOO,
        ONLINE_DPO,
    )
}
"""Every method a job may name, in the order the docs list them."""


def get_method(name: str) -> Method:
    return METHODS[name]


def choices(method: str, name: str) -> tuple[str, ...]:
    """The values a string hyperparameter accepts, for the code that branches on them."""
    values = get_method(method).hyperparameter(name).choices
    assert values is not None, f"{method}.{name} declares no choices"
    return values
