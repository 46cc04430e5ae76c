"""The method registry (trainers/registry.py) is wired everywhere it is read: a method declared there but
missing a piece elsewhere fails here.

- the service reads it without torch; every entry point and config resolves, with the one signature;
- every config field is a run field or built from the registry by ``knob`` (default, doc, API name: one
  declaration), one per declared hyperparameter, and rejects what the API rejects (the ranges too);
- every format is one the upload validator detects;
- a one-step run of every method emits exactly its declared metrics (and eval metrics).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from service.jobs.spec import Method
from tests.trainers.helpers import Recorder, small_config
from trainers.core.config import RolloutConfig, TrainingConfig, knob, registry_default
from trainers.core.errors import DataError
from trainers.families.entry import TrainEntry
from trainers.formats import FileFormat
from trainers.method_docs import FORMAT_SHAPES, PAGES, render
from trainers.registry import LOOP_METRICS, METHODS, Hyperparameter, resolve
from trainers.rewards.reward_set import RewardSet

GRADER = {"type": "string_check", "operation": "eq", "input": "{{sample.output_text}}", "reference": "a"}
# set by the worker, not hyperparameters (keep_checkpoints: the deployment's TUNEHOUSE_CHECKPOINT_KEEP)
RUN_FIELDS = {"model_path", "output_dir", "seed", "resume_from", "keep_checkpoints", "images_dir"}
# set by the worker where a method has it (worker/methods.py build_config)
METHOD_RUN_FIELDS = {"reference_cache_file"}
CHAT = [{"role": "user", "content": "Is Lima a city?"}]
# one valid training file per format, for the one-step runs (a new format needs rows here)
ROWS: dict[str, list[dict[str, Any]]] = {
    "chat": [{"messages": [*CHAT, {"role": "assistant", "content": "Yes, it is."}]}] * 4,
    "prompt_completion": [{"prompt": "Is Lima a city?", "completion": " Yes."}] * 4,
    "text": [{"text": "Lima is the capital of Peru."}] * 4,
    "preference": [{"prompt": "Is Lima a city?", "chosen": " Yes.", "rejected": " No."}] * 4,
    "prompt_only": [{"prompt": "The capital of Peru is", "answer": "e"}] * 4,
    # one desirable and one undesirable example: a step of 2 reports the rewards of both
    "unpaired_preference": [
        {"prompt": "Is Lima a city?", "completion": " Yes.", "label": True},
        {"prompt": "Is Lima a river?", "completion": " Yes.", "label": False},
    ],
}


def test_the_service_reads_the_registry_without_torch() -> None:
    code = (
        # trainers.rewards.graders too: the graders API (service/graders) runs graders in the API process
        "import sys, service.app, service.jobs.spec, trainers.registry, trainers.rewards.formula; "
        "import trainers.rewards.graders; "
        "print(sorted(m for m in ('torch', 'transformers', 'worker') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr


# whether each method's trainer holds a reference policy (its module docstring says so): the registry's
# `reference` must say the same, since the estimate's memory (service/jobs/estimate.py) and the rollout
# configs' `uses_reference` read it there
REFERENCE_CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("supervised", {}, False),
    ("reward_model", {}, False),
    ("orpo", {"beta": 0.1}, False),  # ORPO, CPO and SimPO are reference-free whatever their beta
    ("cpo", {"beta": 0.1}, False),
    ("simpo", {"beta": 2.0}, False),
    ("dpo", {"precompute_ref_log_probs": False}, True),
    ("dpo", {"precompute_ref_log_probs": True}, False),
    ("kto", {"beta": 0.1}, True),
    ("online_dpo", {"beta": 0.1}, True),
    ("grpo", {"beta": 0.0}, False),
    ("grpo", {"beta": 0.04}, True),
    ("reinforcement", {"beta": 0.04}, True),
    ("rloo", {"beta": 0.0}, False),
    ("rloo", {"beta": 0.05}, True),
    ("ppo", {"kl_coef": 0.0}, False),
    ("ppo", {"kl_coef": 0.05}, True),
]


def test_every_method_says_whether_it_holds_a_reference() -> None:
    assert {name for name, _, _ in REFERENCE_CASES} == set(METHODS)


@pytest.mark.parametrize(("name", "hp", "uses"), REFERENCE_CASES)
def test_the_reference_is_declared_once_and_read_by_the_configs(
    name: str, hp: dict[str, Any], uses: bool, tmp_path: Path
) -> None:
    entry = METHODS[name]
    assert entry.uses_reference(hp) is uses
    if entry.reference is not None:  # the knobs it names are the method's own
        for knob_name in (entry.reference.kl_knob, entry.reference.precomputed_knob):
            assert knob_name is None or entry.hyperparameter(knob_name).kind in ("float", "bool")
    config = small_config(name, tmp_path, tmp_path, **hp)
    if isinstance(config, RolloutConfig):
        assert config.uses_reference is uses


@pytest.mark.parametrize("name", METHODS)
def test_entry_point_and_config_resolve_with_the_one_signature(name: str) -> None:
    method = METHODS[name]
    config_cls = resolve(method.config)
    assert issubclass(config_cls, TrainingConfig)
    # the config checks against an entry with the same knobs (reinforcement is GRPO under another name)
    assert METHODS[config_cls.method].hyperparameters == method.hyperparameters
    train = resolve(method.trainer)
    ours = [(p.name, p.kind, p.default) for p in inspect.signature(train).parameters.values()]
    theirs = [(p.name, p.kind, p.default) for p in inspect.signature(TrainEntry.__call__).parameters.values()]
    assert ours[: len(theirs) - 1] == theirs[1:]  # the protocol's `self` aside; extra keyword-only may follow
    extra = ours[len(theirs) - 1 :]
    assert all(
        kind is inspect.Parameter.KEYWORD_ONLY and default is not inspect.Parameter.empty
        for _, kind, default in extra
    )


# the knobs whose config default is the config's own: the registry holds no number for them ("auto" from
# the data size; null, which the worker replaces by the deployment's checkpoint interval)
CONFIG_DEFAULTS = {"n_epochs", "batch_size", "save_minutes"}


@pytest.mark.parametrize("name", METHODS)
def test_every_config_field_is_a_run_field_or_built_from_the_registry(name: str) -> None:
    method = METHODS[name]
    fields = {f.name: f for f in dataclasses.fields(resolve(method.config))}
    declared = {p.field: p for p in method.hyperparameters if p.in_trainer}
    assert set(fields) - METHOD_RUN_FIELDS == set(declared) | RUN_FIELDS
    for field_name, f in fields.items():
        if field_name in RUN_FIELDS | METHOD_RUN_FIELDS:
            assert "hyperparameter" not in f.metadata, field_name
            continue
        # built by knob(): no hand-written default, the API name and the doc come with it
        p = declared[field_name]
        assert f.metadata.get("hyperparameter") == p.name, f"{field_name} is not declared with knob()"
        assert f.metadata["help"]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.metadata["config_default"]:  # only where the registry holds no number a config could take
            assert p.name in CONFIG_DEFAULTS and registry_default(method, p) in (dataclasses.MISSING, None)
            assert p.accepts(default), p.name
        else:
            # this method's own declaration, not only the one the (shared) field was built from
            assert default == registry_default(method, p), p.name
            assert p.name not in CONFIG_DEFAULTS
    for fmt in method.formats:
        FileFormat(fmt)  # a format the upload validator detects
    assert method.learning_rates[0] > method.learning_rates[1] > 0


def test_knob_reads_the_registry_and_refuses_a_second_declaration() -> None:
    f = knob("dpo", "beta")
    assert (f.default, dict(f.metadata)) == (
        0.1,  # "auto" at the API: the registry's auto_value
        {
            "help": METHODS["dpo"].hyperparameter("beta").doc,
            "hyperparameter": "beta",
            "config_default": False,
        },
    )
    assert knob("ppo", "learning_rate").default == METHODS["ppo"].learning_rates[0]  # lora's default: True
    with pytest.raises(ValueError, match="repeats the registry"):
        knob("dpo", "loss_type", default="sigmoid")
    with pytest.raises(ValueError, match="from the data size"):
        knob("dpo", "n_epochs")
    with pytest.raises(ValueError, match="in_trainer"):
        knob("dpo", "learning_rate_multiplier")
    modules = knob("dpo", "lora_target_modules", default=["q_proj"])  # a list: a fresh one per config
    assert (
        modules.default_factory() == ["q_proj"] and modules.default_factory() is not modules.default_factory()
    )


def _outside(p: Hyperparameter) -> list[Any]:
    """Values just outside the declared range (or type) of ``p``."""
    if p.kind == "bool":
        return ["maybe"]
    if p.kind == "str":
        return ["bogus"] if p.choices else [1]
    if p.kind == "str_list":
        return [[1]]
    values: list[Any] = [math.inf] if p.kind == "float" else [1.5]
    if p.ge is not None:
        values.append(p.ge - 1)
    if p.gt is not None:
        values.append(p.gt)
    if p.le is not None:
        values.append(p.le + 1)
    if p.lt is not None:
        values.append(p.lt)
    return values


CASES = [
    (name, p, value)
    for name, m in METHODS.items()
    for p in m.hyperparameters
    if p.in_trainer
    for value in _outside(p)
]


@pytest.mark.parametrize(("name", "p", "value"), CASES, ids=[f"{n}.{p.name}={v!r}" for n, p, v in CASES])
def test_what_the_api_refuses_the_trainer_refuses(name: str, p: Hyperparameter, value: Any) -> None:
    body: dict[str, Any] = {"hyperparameters": {p.name: value}}
    if METHODS[name].grader:
        body["grader"] = GRADER
    with pytest.raises(ValidationError):
        Method.model_validate({"type": name, name: body})
    config = resolve(METHODS[name].config)(model_path="m", output_dir="o", **{p.field: value})
    with pytest.raises(DataError) as info:
        config.validate()
    assert info.value.param == f"hyperparameters.{p.name}"


def test_ppo_mini_batches_must_divide_the_rollout_at_the_api_and_in_the_trainer() -> None:
    ppo = METHODS["ppo"]
    assert ppo.check({"batch_size": 3, "gradient_accumulation_steps": 1, "num_mini_batches": 2}) is not None
    config = resolve(ppo.config)(model_path="m", output_dir="o", batch_size=3, num_mini_batches=2)
    with pytest.raises(DataError, match="num_mini_batches"):
        config.validate()


# -- metrics ------------------------------------------------------------------------------------------------
def ones(prompts: list[str], completions: list[str], **columns: list[Any]) -> list[float]:
    return [1.0] * len(completions)


def _expand(names: tuple[str, ...], grader: str) -> set[str]:
    return {n.replace("{grader}", grader) for n in names}


@pytest.mark.parametrize("name", [n for n in METHODS if n != "reinforcement"])  # reinforcement is GRPO
def test_a_one_step_run_emits_exactly_the_declared_metrics(
    name: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    method = METHODS[name]
    config = small_config(name, tiny_model_path, tmp_path, beta=0.1)  # beta: GRPO's kl is emitted then
    rows = ROWS[method.formats[0]]
    rec = Recorder()
    kwargs: dict[str, Any] = {}
    if method.grader:
        kwargs["rewards"] = RewardSet.of(
            [lambda prompts, completions, **_: [1.0] * len(completions)], names=["g"]
        )
    train: TrainEntry = resolve(method.trainer)
    train(config, rows, rows[:2], rec, **kwargs)
    assert set(rec.steps[0]) == {"step", "epoch", "total_steps", *LOOP_METRICS} | _expand(method.metrics, "g")
    # a grader method's validation samples and grades: a reward, no loss
    loss = set() if method.grader else {"valid_loss"}
    assert set(rec.evals[-1]) == {"step", "epoch", *loss} | _expand(method.eval_metrics, "g")


@pytest.mark.parametrize("name", sorted(PAGES))
def test_docs_tables_are_generated_from_their_declarations(name: str) -> None:
    page = (Path(__file__).resolve().parents[2] / name).read_text(encoding="utf-8")
    assert render(page, PAGES[name]) == page, f"{name} is stale: run `make docs`"
    assert set(FORMAT_SHAPES) == {f.value for f in FileFormat}
