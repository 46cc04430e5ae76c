"""The fields every training method's config shares, built from the method registry, and their checks.

Each method's config (``SFTConfig``, ``DPOConfig``, ``GRPOConfig``, ``RLOOConfig``, ...: one per method)
subclasses ``TrainingConfig``, names its ``trainers.registry`` entry in ``method`` and adds its own
fields. A hyperparameter is declared once, in the registry (name, type, default, range, doc): a config
field for it is ``knob(method, name)``, which reads the default and the help from there, so the worker
builds configs by keyword from the API's values and ``validate`` checks the registry's ranges. The
generated reference of every hyperparameter is docs/methods.md (``make docs``). Only the fields that are
not hyperparameters (where the run reads and writes, the seed, the checkpoints kept) are declared here.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from trainers.core.errors import DataError
from trainers.registry import Hyperparameter, Method, get_method

# the registry entry whose declarations the shared fields are built from: every method declares them
# alike (``COMMON``, ``RL_COMMON``), which tests/trainers/test_registry.py checks method by method, and
# TrainingConfig's own learning rate is SFT's
SHARED = "supervised"
ROLLOUT = "grpo"


def registry_default(method: Method, p: Hyperparameter) -> Any:
    """The default a config field for ``p`` takes from ``method``'s registry entry, read as the service
    reads it: an ``"auto"`` knob's ``auto_value``; ``learning_rate`` (null at the API: the method's base
    rate times the multiplier) the base rate for the default ``lora``; otherwise the declared default.
    ``dataclasses.MISSING`` where the service derives the value from the data size (``"auto"`` without an
    ``auto_value``): there is no number a config could take from the registry."""
    if p.name == "learning_rate":
        lora = method.hyperparameter("lora").default
        return method.learning_rates[0] if lora else method.learning_rates[1]
    if p.auto:
        return dataclasses.MISSING if p.auto_value is None else p.auto_value
    return p.default


def knob(method: str, name: str, *, default: Any = dataclasses.MISSING) -> Any:
    """The dataclass field of ``method``'s hyperparameter ``name`` (the API name; the field may be named
    differently, ``lora`` -> ``use_lora``): default from the registry (``registry_default``), its doc as
    ``metadata["help"]`` and the API name as ``metadata["hyperparameter"]``.

    ``default`` is for the knobs whose registry value no config can hold: an ``"auto"`` the service
    derives from the data size (``n_epochs``, ``batch_size``), or a null the worker replaces by the
    deployment's setting (``save_minutes``). A config built by hand (tests, benches) needs a number then;
    ``metadata["config_default"]`` marks it. Repeating the registry's value is refused.
    """
    entry = get_method(method)
    p = entry.hyperparameter(name)
    if not p.in_trainer:
        raise ValueError(f"{method}.{name} is not a trainer hyperparameter (in_trainer=False)")
    declared = registry_default(entry, p)
    by_hand = default is not dataclasses.MISSING
    if not by_hand:
        if declared is dataclasses.MISSING:
            raise ValueError(f"{method}.{name}: 'auto' from the data size; give the config's own default")
        default = declared
    elif default == declared:
        raise ValueError(f"{method}.{name}: default={default!r} repeats the registry's; leave it out")
    metadata = {"help": p.doc, "hyperparameter": p.name, "config_default": by_hand}
    if isinstance(default, list | dict | set):  # a mutable default: one copy per config
        return dataclasses.field(default_factory=lambda: copy.copy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass
class TrainingConfig:
    """The fields every method config has: the registry's ``COMMON`` hyperparameters (``knob``; their
    docs are each field's ``metadata["help"]`` and docs/methods.md) and the run's own fields below.

    Run (set by the worker, not job hyperparameters):
        model_path: a local Hugging Face folder (or a hub id where the host is online).
        output_dir: local folder that receives ``checkpoint-{step:06d}/`` folders.
        seed: seeds LoRA initialisation, dropout and the data order.
        keep_checkpoints: resumable checkpoints kept in ``output_dir``; older ones are deleted as new
            ones are written (the final checkpoint is never deleted). The worker sets it from the
            deployment's ``TUNEHOUSE_CHECKPOINT_KEEP``.
        resume_from: a checkpoint folder written by this library; training continues from it exactly.
        images_dir: a folder of the images the service fetched for the rows' http(s) image URLs at upload
            (``trainers.data.vision.ImageFiles``); None: the rows' images are data URLs.

    How the loop reads the shared hyperparameters, beyond their one-line docs: an optimizer step sees
    ``batch_size * gradient_accumulation_steps`` examples (fewer at the end of an epoch); weight decay
    applies to matrices only; ``eval_steps`` runs validation only when validation rows are given, and
    always after the last step; with ``save_steps`` 0 and ``save_minutes`` 0 only the final checkpoint is
    written. Each method documents how it reads them where that differs.
    """

    method: ClassVar[str]  # the trainers.registry entry whose ranges ``validate`` checks

    model_path: str
    output_dir: str
    use_lora: bool = knob(SHARED, "lora")
    lora_r: int = knob(SHARED, "lora_r")
    lora_alpha: int = knob(SHARED, "lora_alpha")
    lora_dropout: float = knob(SHARED, "lora_dropout")
    lora_target_modules: list[str] | None = knob(SHARED, "lora_target_modules")
    quantization: str | None = knob(SHARED, "quantization")
    # a job's "auto" epochs and batch size come from its data size (service/jobs/spec.py); by hand: these
    n_epochs: int = knob(SHARED, "n_epochs", default=1)
    batch_size: int = knob(SHARED, "batch_size", default=4)
    gradient_accumulation_steps: int = knob(SHARED, "gradient_accumulation_steps")
    learning_rate: float = knob(SHARED, "learning_rate")
    lr_scheduler: str = knob(SHARED, "lr_scheduler")
    warmup_ratio: float = knob(SHARED, "warmup_ratio")
    weight_decay: float = knob(SHARED, "weight_decay")
    max_grad_norm: float = knob(SHARED, "max_grad_norm")
    mixed_precision: str = knob(SHARED, "mixed_precision")
    gradient_checkpointing: bool = knob(SHARED, "gradient_checkpointing")
    seed: int = 42
    max_steps: int | None = knob(SHARED, "max_steps")
    save_steps: int = knob(SHARED, "save_steps")
    # null at the API: the worker puts the deployment's TUNEHOUSE_CHECKPOINT_MINUTES (10); by hand: 10
    save_minutes: float = knob(SHARED, "save_minutes", default=10.0)
    keep_checkpoints: int = 3
    eval_steps: int = knob(SHARED, "eval_steps")
    resume_from: str | None = None
    images_dir: str | None = None

    def hyperparameters(self) -> dict[str, Any]:
        """The config's hyperparameters by their API names (``lora``, not ``use_lora``), as the service
        holds them."""
        entry = get_method(self.method)
        return {p.name: getattr(self, p.field) for p in entry.hyperparameters if p.in_trainer}

    def validate(self) -> None:
        """Raise ``DataError`` naming the first hyperparameter out of range.

        The ranges are the method's declaration in ``trainers.registry`` (the same the API validates
        with), checked in declaration order, then the method's cross-field constraints.
        """
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        problem = get_method(self.method).check(values, by_field=True)
        if problem is None and self.keep_checkpoints < 1:  # the one run-control field the API lacks
            problem = (
                "keep_checkpoints",
                f"keep_checkpoints={self.keep_checkpoints!r} is out of range: expected >= 1",
            )
        if problem is not None:
            name, message = problem
            raise DataError(message, param=f"hyperparameters.{name}")


@dataclass
class VisionConfig(TrainingConfig):
    """The fields of the methods that train on images (``Method.images``): the registry's ``VISION``
    knobs, what of a vision base trains beside its language model (``trainers.modeling.vision``)."""

    train_vision_tower: bool = knob(SHARED, "train_vision_tower")
    train_projector: bool = knob(SHARED, "train_projector")


@dataclass
class RolloutConfig(TrainingConfig):
    """The fields of every method that samples from the policy it trains (GRPO, PPO, RLOO, online DPO):
    the registry's ``RL_COMMON`` hyperparameters. Beyond their docs: a completion without EOS is truncated
    at ``max_completion_length``; ``eval_sampling="sample"`` draws from the same seed at every evaluation;
    the grader scores the validation completions: ``valid_reward`` is the mean weighted reward,
    ``valid_reward/{grader}`` each reward function's mean (``trainers.families.rl.reward_evaluator``).
    """

    max_prompt_length: int = knob(ROLLOUT, "max_prompt_length")
    max_completion_length: int = knob(ROLLOUT, "max_completion_length")
    temperature: float = knob(ROLLOUT, "temperature")
    top_p: float = knob(ROLLOUT, "top_p")
    eval_sampling: str = knob(ROLLOUT, "eval_sampling")

    @property
    def uses_reference(self) -> bool:
        """Whether the method compares the policy with the base model (then a full fine-tune loads a
        frozen copy of it; LoRA disables its adapter instead): the registry entry's ``reference``."""
        return get_method(self.method).uses_reference(self.hyperparameters())
