"""The spec and the trainers agree: every registered method's hyperparameters map onto its config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.jobs.spec import Method, MethodBase, resolve_hyperparameters
from trainers.registry import METHODS
from worker.methods import RunInputs, build_config, learning_rate, trainer_fields

GRADER = {"type": "string_check", "operation": "eq", "input": "{{sample.output_text}}", "reference": "a"}
INPUTS = RunInputs(
    model_path="m", output_dir=Path("/tmp/out"), seed=3, resume_from=None, train_rows=[], valid_rows=None
)


def resolved(method_type: str, **hyperparameters: Any) -> MethodBase:
    body: dict[str, Any] = {"hyperparameters": hyperparameters}
    if METHODS[method_type].grader:
        body["grader"] = GRADER
    method = Method.model_validate({"type": method_type, method_type: body})
    resolve_hyperparameters(method, n_examples=64)
    return method


@pytest.mark.parametrize("method_type", METHODS)
def test_every_hyperparameter_reaches_the_trainer_config(method_type: str) -> None:
    method = resolved(method_type)
    config = build_config(method, INPUTS)
    hp = method.hyperparameters.model_dump()
    for p in METHODS[method_type].hyperparameters:
        if p.in_trainer and p.name not in ("learning_rate", "save_minutes"):
            assert getattr(config, p.field) == hp[p.name], p.name
    assert config.use_lora is True and config.seed == 3 and config.model_path == "m"
    assert config.learning_rate == pytest.approx(learning_rate(method))
    config.validate()  # what the API accepted, the trainer accepts


def test_dpo_beta_auto_resolves_to_paper_default() -> None:
    config = build_config(resolved("dpo", loss_type="ipo"), INPUTS)
    assert config.beta == 0.1 and config.loss_type == "ipo"


def test_base_learning_rates_scale_with_the_multiplier() -> None:
    assert learning_rate(resolved("ppo", learning_rate_multiplier=2.0)) == pytest.approx(2e-5)
    assert learning_rate(resolved("ppo", lora=False)) == pytest.approx(1e-6)
    assert learning_rate(resolved("ppo", learning_rate=3e-4)) == pytest.approx(3e-4)


def test_auto_batch_size_respects_the_methods_minimum() -> None:
    # 4 examples make an "auto" batch of 1; KTO's KL estimate needs 2 examples per micro-batch
    for method_type, expected in (("dpo", 1), ("kto", 2)):
        method = Method.model_validate({"type": method_type})
        resolve_hyperparameters(method, n_examples=4)
        assert method.hyperparameters.model_dump()["batch_size"] == expected, method_type


def test_checkpoint_policy_defaults_to_the_deployment_and_a_job_overrides_it() -> None:
    inputs = RunInputs("m", Path("/tmp"), 0, None, [], None, save_minutes=2.5, keep_checkpoints=5)
    config = build_config(resolved("supervised"), inputs)  # the job leaves save_minutes null
    assert (config.save_minutes, config.keep_checkpoints) == (2.5, 5)
    assert build_config(resolved("supervised", save_minutes=0), inputs).save_minutes == 0


@pytest.mark.parametrize("method_type", METHODS)
def test_learning_rate_is_the_base_rate_times_the_multiplier(method_type: str) -> None:
    lora_lr, full_lr = METHODS[method_type].learning_rates
    assert learning_rate(resolved(method_type)) == pytest.approx(lora_lr)
    assert learning_rate(resolved(method_type, lora=False)) == pytest.approx(full_lr)
    assert learning_rate(resolved(method_type, learning_rate_multiplier=3.0)) == pytest.approx(3 * lora_lr)
    assert learning_rate(resolved(method_type, learning_rate=0.25, lora=False)) == 0.25  # given: as is


def test_trainer_fields_use_the_trainers_names() -> None:
    fields = trainer_fields(resolved("supervised", lora=False, n_epochs=2))
    assert fields["use_lora"] is False and "lora" not in fields
    assert fields["n_epochs"] == 2 and fields["batch_size"] == 8
    assert "learning_rate_multiplier" not in fields  # API-only: it becomes the learning rate
    assert fields["learning_rate"] == pytest.approx(METHODS["supervised"].learning_rates[1])
    in_trainer = {p.field for p in METHODS["supervised"].hyperparameters if p.in_trainer}
    assert set(fields) == in_trainer | {"learning_rate"}


def test_nothing_reaches_a_trainer_before_auto_is_resolved() -> None:
    method = Method.model_validate({"type": "supervised"})
    for read in (learning_rate, trainer_fields):
        with pytest.raises(ValueError, match=r"^hyperparameters must be resolved first$"):
            read(method)
