"""From a job's method to a trainer run. The spec's hyperparameter names are the trainers' config field
names (service/jobs/spec.py), so one mapping serves every method; each method only names its config
class and entry point. All of them run on the same loop (trainers/loop.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.jobs.spec import Method, trainer_fields
from trainers.loop import TrainingCallbacks, TrainResult


@dataclass(frozen=True)
class RunInputs:
    model_path: str
    output_dir: Path
    seed: int
    resume_from: Path | None
    train_rows: list[dict[str, Any]]
    valid_rows: list[dict[str, Any]] | None
    # RL methods: the job's grader as reward functions (worker/graders.py), with their metric names
    reward_funcs: list[Any] = field(default_factory=list)
    reward_names: list[str] = field(default_factory=list)


def build_config(config_cls: type[Any], method: Method, inputs: RunInputs) -> Any:
    fields = trainer_fields(method)
    names = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(fields) - names)
    if unknown:  # a spec field the trainer does not know: our bug, caught by tests/worker/test_methods.py
        raise RuntimeError(f"{config_cls.__name__} has no fields {unknown}")
    return config_cls(
        **fields,
        model_path=inputs.model_path,
        output_dir=str(inputs.output_dir),
        seed=inputs.seed,
        resume_from=str(inputs.resume_from) if inputs.resume_from else None,
    )


def config_class(method_type: str) -> type[Any]:
    if method_type == "supervised":
        from trainers.sft import SFTConfig

        return SFTConfig
    if method_type == "dpo":
        from trainers.dpo import DPOConfig

        return DPOConfig
    if method_type == "reward_model":
        from trainers.reward_model import RewardModelConfig

        return RewardModelConfig
    if method_type in ("grpo", "reinforcement"):
        from trainers.grpo import GRPOConfig

        return GRPOConfig
    if method_type == "ppo":
        from trainers.ppo import PPOConfig

        return PPOConfig
    raise NotImplementedError(f"method '{method_type}' is not wired into the worker")


def run_method(method: Method, inputs: RunInputs, callbacks: TrainingCallbacks) -> TrainResult:
    config = build_config(config_class(method.type), method, inputs)
    if method.type == "supervised":
        from trainers.sft import train_sft

        return train_sft(config, inputs.train_rows, inputs.valid_rows, callbacks)
    if method.type == "dpo":
        from trainers.dpo import train_dpo

        return train_dpo(config, inputs.train_rows, inputs.valid_rows, callbacks)
    if method.type == "reward_model":
        from trainers.reward_model import train_reward_model

        return train_reward_model(config, inputs.train_rows, inputs.valid_rows, callbacks)
    if method.type in ("grpo", "reinforcement"):
        from trainers.grpo import train_grpo

        return train_grpo(
            config, inputs.train_rows, inputs.reward_funcs, callbacks, reward_names=inputs.reward_names
        )
    if method.type == "ppo":
        from trainers.ppo import train_ppo

        return train_ppo(
            config, inputs.train_rows, inputs.reward_funcs, callbacks, reward_names=inputs.reward_names
        )
    raise NotImplementedError(f"method '{method.type}' is not wired into the worker")
