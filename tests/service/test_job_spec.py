"""The job spec (service/jobs/spec.py), in this process: what a job body may hold, how "auto" resolves
from the data, and the learning rate and trainer fields a resolved spec hands the worker.

tests/service/test_jobs_api.py checks the same rules through the API (status codes, `param`); these
tests call the models directly so that the mutation check can trace them to the code
(`make mutants MODULES=service/jobs/spec.py`).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from service.jobs.spec import (
    BODIES,
    JobCreate,
    Method,
    MethodBase,
    hyperparameter_problem,
    load_method,
    resolve_hyperparameters,
    resolved_values,
    stored_method,
)
from trainers.registry import AUTO, METHODS

GRADER = {"type": "string_check", "operation": "eq", "input": "{{sample.output_text}}", "reference": "a"}
JOB = {"model": "tunehouse/tiny-llama", "training_file": "file-abc"}


def method(method_type: str, **hyperparameters: Any) -> MethodBase:
    body: dict[str, Any] = {"hyperparameters": hyperparameters}
    if METHODS[method_type].grader:
        body["grader"] = GRADER
    return Method.model_validate({"type": method_type, method_type: body})


def errors(data: dict[str, Any], model: Any = JobCreate) -> list[tuple[str, str]]:
    """(location, message) of each error pydantic reports for `data`."""
    with pytest.raises(ValidationError) as raised:
        model.model_validate(data)
    return [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in raised.value.errors()]


# -- the method object --------------------------------------------------------------------------------------
def test_a_method_without_its_body_gets_the_defaults() -> None:
    m = Method.model_validate({"type": "dpo"})
    assert m.type == "dpo" and m.declaration is METHODS["dpo"]
    hp = m.hyperparameters.model_dump()
    assert {p.name: hp[p.name] for p in METHODS["dpo"].hyperparameters} == {
        p.name: p.default for p in METHODS["dpo"].hyperparameters
    }
    assert m.grader is None


def test_a_body_for_another_method_is_refused() -> None:
    (problem,) = errors({"type": "supervised", "dpo": {}}, Method)
    assert problem == ("", "Value error, method.dpo given but method.type is 'supervised'")


def test_a_method_body_holds_only_its_fields() -> None:
    problems = errors({"type": "supervised", "supervised": {"hyperparameters": {}, "grader": GRADER}}, Method)
    assert [w for w, _ in problems] == ["supervised.grader"]
    problems = errors({"type": "supervised", "supervised": {"hyperparameters": {}, "epochs": 3}}, Method)
    assert [w for w, _ in problems] == ["supervised.epochs"]


def test_an_online_method_needs_its_grader() -> None:
    (problem,) = errors({"type": "grpo"}, Method)
    assert problem == ("", "Value error, method.grpo with a 'grader' is required for method 'grpo'")
    assert errors({"type": "grpo", "grpo": {"hyperparameters": {}}}, Method)[0][0] == "grpo.grader"
    m = method("grpo")
    assert m.grader is not None and m.grader.model_dump()["reference"] == "a"


def test_the_method_type_is_one_of_the_registry() -> None:
    ((where, _),) = errors({"type": "rlhf"}, Method)
    assert where == "type"


@pytest.mark.parametrize(
    ("hyperparameters", "where"),
    [
        ({"n_epochs": True}, "n_epochs"),  # strict: a bool is not an int
        ({"n_epochs": 1.5}, "n_epochs"),
        ({"n_epochs": 0}, "n_epochs"),
        ({"n_epochs": 101}, "n_epochs"),
        ({"n_epochs": "3"}, "n_epochs"),
        ({"batch_size": 1025}, "batch_size"),
        ({"learning_rate_multiplier": 0}, "learning_rate_multiplier"),
        ({"learning_rate_multiplier": math.inf}, "learning_rate_multiplier"),
        ({"learning_rate_multiplier": math.nan}, "learning_rate_multiplier"),
        ({"n_epochs": "many"}, "n_epochs"),
        ({"lora": "yes"}, "lora"),
        ({"n_epoch": 3}, "n_epoch"),  # a typo is an error, not ignored
        ({"lora_dropout": 1.0}, "lora_dropout"),  # lt 1
        ({"lr_scheduler": "polynomial"}, "lr_scheduler"),  # one of its choices
        ({"max_grad_norm": math.inf}, "max_grad_norm"),  # no upper bound, but finite
        ({"max_grad_norm": math.nan}, "max_grad_norm"),
    ],
)
def test_hyperparameters_out_of_range_or_type_name_the_field(
    hyperparameters: dict[str, Any], where: str
) -> None:
    problems = errors({"type": "supervised", "supervised": {"hyperparameters": hyperparameters}}, Method)
    assert {w.split(".")[2] for w, _ in problems} == {where}, problems


def test_an_unbounded_float_is_still_finite() -> None:
    for value in (math.inf, -math.inf, math.nan):
        problems = errors(
            {"type": "ppo", "ppo": {"grader": GRADER, "hyperparameters": {"vf_coef": value}}}, Method
        )
        assert {w.split(".")[2] for w, _ in problems} == {"vf_coef"}, (value, problems)
    assert method("ppo", missing_eos_penalty=-1.5).hyperparameters.model_dump()["missing_eos_penalty"] == -1.5
    assert errors(
        {"type": "ppo", "ppo": {"grader": GRADER, "hyperparameters": {"missing_eos_penalty": math.nan}}},
        Method,
    )


def test_the_models_are_named_after_their_method() -> None:
    """The names clients see in the OpenAPI schema and GET /v1/methods."""
    assert BODIES["online_dpo"].__name__ == "OnlineDpoMethod"
    hp = BODIES["online_dpo"].model_fields["hyperparameters"].annotation
    assert hp is not None and hp.__name__ == "OnlineDpoHyperparameters"
    assert BODIES["supervised"].__name__ == "SupervisedMethod"


def test_auto_is_taken_only_where_declared() -> None:
    assert (
        method("supervised", n_epochs=AUTO, batch_size=AUTO).hyperparameters.model_dump()["n_epochs"] == AUTO
    )
    no_auto = next(p for p in METHODS["supervised"].hyperparameters if not p.auto and p.kind == "int")
    assert errors({"type": "supervised", "supervised": {"hyperparameters": {no_auto.name: AUTO}}}, Method)


def test_every_method_body_is_built_from_the_registry() -> None:
    assert set(BODIES) == set(METHODS)
    for name, m in METHODS.items():
        fields = BODIES[name].model_fields
        assert ("grader" in fields) == m.grader, name
        hp = fields["hyperparameters"].annotation
        assert set(hp.model_fields) == {p.name for p in m.hyperparameters}, name  # type: ignore[union-attr]


# -- "auto" resolved from the data --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "batch_size", "n_epochs"),
    [
        (1, 1, 10),
        (8, 1, 10),
        (16, 2, 10),
        (26, 3, 10),
        (32, 4, 8),
        (64, 8, 4),
        (100, 8, 3),
        (256, 8, 1),
        (10_000, 8, 1),
    ],
)
def test_auto_batch_size_and_epochs_follow_the_data_size(n: int, batch_size: int, n_epochs: int) -> None:
    m = method("supervised")
    resolve_hyperparameters(m, n_examples=n)
    hp = m.hyperparameters.model_dump()
    assert (hp["batch_size"], hp["n_epochs"], hp["learning_rate_multiplier"]) == (batch_size, n_epochs, 1.0)


def test_given_values_are_kept_and_a_methods_minimum_wins() -> None:
    m = method("supervised", batch_size=3, n_epochs=2, learning_rate_multiplier=0.5)
    resolve_hyperparameters(m, n_examples=1000)
    hp = m.hyperparameters.model_dump()
    assert (hp["batch_size"], hp["n_epochs"], hp["learning_rate_multiplier"]) == (3, 2, 0.5)
    kto = method("kto")
    resolve_hyperparameters(kto, n_examples=4)  # the data rule says 1; KTO needs 2 per micro-batch
    assert kto.hyperparameters.model_dump()["batch_size"] == 2


def test_auto_without_a_data_rule_takes_the_registrys_value() -> None:
    m = method("dpo")
    resolve_hyperparameters(m, n_examples=64)
    beta = next(p for p in METHODS["dpo"].hyperparameters if p.name == "beta")
    assert beta.auto and m.hyperparameters.model_dump()["beta"] == beta.auto_value == 0.1


def test_nothing_is_read_before_auto_is_resolved() -> None:
    m = method("supervised")
    for read in (resolved_values, hyperparameter_problem):
        with pytest.raises(ValueError, match=r"^hyperparameters must be resolved first$"):
            read(m)


# -- what the worker gets -----------------------------------------------------------------------------------
def _resolved(method_type: str, **hyperparameters: Any) -> MethodBase:
    m = method(method_type, **hyperparameters)
    resolve_hyperparameters(m, n_examples=64)
    return m


def test_a_cross_field_problem_names_its_parameter() -> None:
    assert hyperparameter_problem(_resolved("ppo")) is None
    param, message = hyperparameter_problem(_resolved("ppo", batch_size=3, num_mini_batches=2)) or ("", "")
    assert param.startswith("method.ppo.hyperparameters.") and param.endswith(
        ("num_mini_batches", "batch_size")
    )
    assert "num_mini_batches" in message


def test_a_stored_method_loads_back_the_same() -> None:
    m = _resolved("grpo", beta=0.04)
    stored = stored_method(m)
    assert stored["type"] == "grpo" and stored["grpo"]["hyperparameters"]["beta"] == 0.04
    assert "dpo" not in stored  # no empty bodies of other methods
    again = load_method(stored)
    assert again.hyperparameters == m.hyperparameters and stored_method(again) == stored


# -- the job body -------------------------------------------------------------------------------------------
def test_a_minimal_job_body() -> None:
    job = JobCreate.model_validate(JOB)
    assert (job.method, job.hyperparameters, job.resources, job.seed, job.suffix) == (
        None,
        None,
        None,
        None,
        None,
    )


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        ({"model": ""}, "model"),
        ({"model": "m" * 501}, "model"),
        ({"training_file": ""}, "training_file"),
        ({"suffix": ""}, "suffix"),
        ({"suffix": "s" * 65}, "suffix"),
        ({"suffix": "a b"}, "suffix"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**31}, "seed"),
        ({"seed": "1"}, "seed"),
        ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs"),
        ({"hyperparameters": {"batch_size": 1025}}, "hyperparameters.batch_size"),
        ({"hyperparameters": {"learning_rate_multiplier": 0}}, "hyperparameters.learning_rate_multiplier"),
        ({"hyperparameters": {"learning_rate_multiplier": 101}}, "hyperparameters.learning_rate_multiplier"),
        ({"hyperparameters": {"beta": 0.1}}, "hyperparameters.beta"),  # the legacy form is supervised only
        ({"resources": {"gpus": 0}}, "resources.gpus"),
        ({"resources": {"gpus": 65}}, "resources.gpus"),
        ({"resources": {"strategy": "zero3"}}, "resources.strategy"),
        ({"resources": {"nodes": 0}}, "resources.nodes"),
        ({"resources": {"nodes": 1025}}, "resources.nodes"),
        ({"resources": {"gpus_per_node": 0}}, "resources.gpus_per_node"),
        ({"color": "red"}, "color"),
    ],
)
def test_job_fields_out_of_range_name_the_field(extra: dict[str, Any], where: str) -> None:
    problems = errors(JOB | extra)
    # a union's error names the member it tried after the field (`...learning_rate_multiplier.literal`)
    assert {w if w == where else w[: len(where)] for w, _ in problems} == {where}, problems


def test_job_fields_at_their_bounds_are_accepted() -> None:
    job = JobCreate.model_validate(
        JOB
        | {
            "model": "m" * 500,
            "suffix": "A-z_0.9" + "s" * 57,
            "seed": 2**31 - 1,
            "hyperparameters": {"n_epochs": 100, "batch_size": 1024, "learning_rate_multiplier": 100},
            "resources": {"gpus": 64},
        }
    )
    assert job.seed == 2**31 - 1 and job.resources is not None and job.resources.gpus == 64
    assert (
        JobCreate.model_validate(JOB | {"seed": 0, "hyperparameters": {"n_epochs": 1, "batch_size": 1}}).seed
        == 0
    )
