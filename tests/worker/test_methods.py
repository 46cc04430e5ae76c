"""The spec and the trainers agree: every runnable method's hyperparameters map onto its config."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.jobs.spec import RL_METHODS, RUNNABLE_METHODS, Method, learning_rate, resolve_hyperparameters
from worker.methods import RunInputs, build_config, config_class


@pytest.mark.parametrize("method_type", RUNNABLE_METHODS)
def test_every_hyperparameter_reaches_the_trainer_config(method_type: str) -> None:
    body = {
        "grader": {
            "type": "string_check",
            "operation": "eq",
            "input": "{{sample.output_text}}",
            "reference": "a",
        }
    }
    method = Method.model_validate(
        {"type": method_type, method_type: body if method_type in RL_METHODS else {}}
    )
    resolve_hyperparameters(method, n_examples=64)
    inputs = RunInputs(
        model_path="m", output_dir=Path("/tmp/out"), seed=3, resume_from=None, train_rows=[], valid_rows=None
    )
    config = build_config(config_class(method_type), method, inputs)
    hp = method.hyperparameters
    assert config.n_epochs == hp.n_epochs and config.batch_size == hp.batch_size
    assert config.use_lora == hp.lora and config.seed == 3 and config.model_path == "m"
    assert config.learning_rate == pytest.approx(learning_rate(method))


def test_dpo_beta_auto_resolves_to_paper_default() -> None:
    method = Method.model_validate({"type": "dpo", "dpo": {"hyperparameters": {"loss_type": "ipo"}}})
    resolve_hyperparameters(method, n_examples=10)
    config = build_config(config_class("dpo"), method, RunInputs("m", Path("/tmp"), 0, None, [], None))
    assert config.beta == 0.1 and config.loss_type == "ipo"
