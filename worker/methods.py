"""From a job's method to a trainer run: the one owner of spec -> trainer config. Through the method
registry (trainers/registry.py): the entry names the config class and the train function by import path,
every train function has the same signature (trainers/families/entry.py), and the spec's hyperparameter
names are the config's field names, so one mapping serves every method. All of them run on the same loop
(trainers/core/loop.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.jobs.spec import MethodBase, resolved_values
from trainers.core.loop import TrainingCallbacks, TrainResult
from trainers.families.entry import Rows
from trainers.registry import resolve

if TYPE_CHECKING:
    from trainers.rewards.reward_set import RewardSet


@dataclass(frozen=True)
class RunInputs:
    model_path: str
    output_dir: Path
    seed: int
    resume_from: Path | None
    train_rows: Rows
    valid_rows: Rows | None
    # RL methods: the job's grader as reward functions (worker/graders.py)
    rewards: RewardSet | None = None
    # the deployment's checkpoint policy (settings.checkpoint_minutes / checkpoint_keep); a job's own
    # `save_minutes` wins
    save_minutes: float = 10.0
    keep_checkpoints: int = 3
    # DPO with precomputed reference log-probs: the file that keeps them between jobs on the same training
    # file (`trainers.families.reference_cache`), fetched from and stored back to the blob store by the job
    # process
    reference_cache_file: Path | None = None
    # the images the service fetched for the files' http(s) image URLs at upload, with their index
    # (trainers.data.vision.ImageFiles); None: the files fetched none
    images_dir: Path | None = None


def learning_rate(method: MethodBase) -> float:
    """The job's learning rate: as given, else the method's base rate (LoRA or full) x the multiplier."""
    values = resolved_values(method)
    if values["learning_rate"] is not None:
        return float(values["learning_rate"])
    lora_lr, full_lr = method.declaration.learning_rates
    return (lora_lr if values["lora"] else full_lr) * float(values["learning_rate_multiplier"])


def trainer_fields(method: MethodBase) -> dict[str, Any]:
    """Resolved hyperparameters under the trainers' config field names."""
    values = resolved_values(method)
    fields = {p.field: values[p.name] for p in method.declaration.hyperparameters if p.in_trainer}
    fields["learning_rate"] = learning_rate(method)
    return fields


def build_config(method: MethodBase, inputs: RunInputs) -> Any:
    """The one translation of a job's spec into its trainer's config: the hyperparameters by field name,
    the learning rate resolved, plus the run's own fields (paths, seed, checkpoint policy)."""
    config_cls = resolve(method.declaration.config)
    fields = trainer_fields(method)
    if fields.get("save_minutes") is None:
        fields["save_minutes"] = inputs.save_minutes
    fields["keep_checkpoints"] = inputs.keep_checkpoints
    names = {f.name for f in dataclasses.fields(config_cls)}
    if inputs.reference_cache_file is not None:  # given only where `keeps_reference_log_probs(method)`
        fields["reference_cache_file"] = str(inputs.reference_cache_file)
    unknown = sorted(set(fields) - names)
    if unknown:  # a spec field the trainer does not know: our bug, caught by tests/trainers/test_registry.py
        raise RuntimeError(f"{config_cls.__name__} has no fields {unknown}")
    return config_cls(
        **fields,
        model_path=inputs.model_path,
        output_dir=str(inputs.output_dir),
        seed=inputs.seed,
        resume_from=str(inputs.resume_from) if inputs.resume_from else None,
        images_dir=str(inputs.images_dir) if inputs.images_dir else None,
    )


def keeps_reference_log_probs(method: MethodBase) -> bool:
    """Whether the method precomputes reference log-probs that a later job on its file can reuse."""
    config_fields = {f.name for f in dataclasses.fields(resolve(method.declaration.config))}
    precomputes = bool(trainer_fields(method).get("precompute_ref_log_probs"))
    return "reference_cache_file" in config_fields and precomputes


def run_method(method: MethodBase, inputs: RunInputs, callbacks: TrainingCallbacks) -> TrainResult:
    train = resolve(method.declaration.trainer)
    result: TrainResult = train(
        build_config(method, inputs), inputs.train_rows, inputs.valid_rows, callbacks, rewards=inputs.rewards
    )
    return result
