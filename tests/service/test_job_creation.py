"""Creating a job (service/jobs/creation.py) on real PostgreSQL and the real idle Redis broker, in this
process: every refusal with its 4xx word for word (code, param) and nothing stored; the stored row, its
resolved hyperparameters, events and queue; its run message sent to the broker only after the commit.

In-process (not through the API server) so that the mutation check can trace these tests to the code
(`make mutants MODULES=service/jobs/creation.py`); tests/service/test_jobs_api.py covers the route.
The rows live in a database of this module's own, away from the e2e worker's reconciler.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import func, select

import service.queue
from service.base_models.catalog import TINY_MODEL_NAME
from service.base_models.tinker_checkpoints import record_tinker_checkpoint
from service.config import Settings, get_settings
from service.db import session_scope
from service.errors import AppError, BadRequest, NotFound
from service.ids import new_id
from service.jobs.capacity import advertise
from service.jobs.creation import create_job
from service.jobs.spec import JobCreate, load_method, resolve_hyperparameters, stored_method
from service.models import Checkpoint, File, Job, JobEvent, Tenant
from service.queue import RUN_JOB_TASK
from tests.conftest import IDLE_BROKER, IDLE_QUEUE, free_port
from tests.helpers import job_row, new_tenant

Waiting = Callable[[], list[tuple[str, list[Any]]]]


pytestmark = pytest.mark.usefixtures("use_module_database")


@pytest.fixture
def tenant() -> Tenant:
    return new_tenant("creation")


def _file(tenant: Tenant, *, purpose: str = "fine-tune", fmt: str = "chat", lines: int = 40) -> str:
    with session_scope() as session:
        row = File(
            id=new_id("file"),
            tenant_id=tenant.id,
            filename="train.jsonl",
            purpose=purpose,
            bytes=100,
            sha256="0" * 64,
            line_count=lines,
            format=fmt,
            blob_key=f"files/{new_id('blob')}",
        )
        session.add(row)
    return row.id


def _create(tenant: Tenant, body: dict[str, Any], settings: Settings | None = None) -> Job:
    spec = JobCreate.model_validate({"model": TINY_MODEL_NAME, **body})
    with session_scope() as session:
        return create_job(session, tenant=tenant, spec=spec, settings=settings or get_settings())


def _stored(tenant: Tenant) -> tuple[int, int]:
    """(jobs, events) of the tenant: what a refused request must leave as it was."""
    with session_scope() as session:
        jobs = session.scalar(select(func.count()).select_from(Job).where(Job.tenant_id == tenant.id))
        events = session.scalar(
            select(func.count()).select_from(JobEvent).join(Job).where(Job.tenant_id == tenant.id)
        )
    return int(jobs or 0), int(events or 0)


def _refused(tenant: Tenant, body: dict[str, Any], settings: Settings | None = None) -> AppError:
    before = _stored(tenant)
    with pytest.raises(AppError) as raised:
        _create(tenant, body, settings)
    assert _stored(tenant) == before
    return raised.value


def test_a_job_is_stored_queued_with_its_events_and_sent_after_commit(
    tenant: Tenant, idle_broker: Waiting
) -> None:
    train, valid = _file(tenant, lines=40), _file(tenant, lines=8)
    before = time.time()
    supervised = {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2}}}
    body: dict[str, Any] = {
        "training_file": train,
        "validation_file": valid,
        "suffix": "mine",
        "seed": 11,
        "metadata": {"team": "a"},
        "method": supervised,
    }
    spec = JobCreate.model_validate({"model": TINY_MODEL_NAME, **body})
    with session_scope() as session:
        job = create_job(session, tenant=tenant, spec=spec, settings=get_settings())
        assert (RUN_JOB_TASK, [job.id]) not in idle_broker()  # not before the commit
    assert idle_broker()[-1] == (RUN_JOB_TASK, [job.id])
    with session_scope() as session:
        row = session.get(Job, job.id)
        assert row is not None
        events = [
            (e.message, e.data)
            for e in session.scalars(select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.seq))
        ]
    assert job.id.startswith("ftjob-")
    assert (row.tenant_id, row.model, row.training_file, row.validation_file) == (
        tenant.id,
        TINY_MODEL_NAME,
        train,
        valid,
    )
    assert (row.status, row.suffix, row.seed, row.user_metadata, row.queue) == (
        "queued",
        "mine",
        11,
        {"team": "a"},
        IDLE_QUEUE,
    )
    assert row.resources == {"nodes": 1, "gpus_per_node": 1, "strategy": "ddp"}
    assert row.queued_at is not None and before <= row.queued_at <= time.time()
    hyper = row.method["supervised"]["hyperparameters"]
    assert row.method["type"] == "supervised" and hyper["n_epochs"] == 2
    # "auto" resolved from the training file's 40 examples (not the validation file's 8)
    expected = {}
    for n in (40, 8):
        method = load_method(supervised)
        resolve_hyperparameters(method, n_examples=n)
        expected[n] = stored_method(method)["supervised"]["hyperparameters"]
    assert expected[40] != expected[8] and hyper == expected[40]
    assert events == [
        (f"Validating training file: {train}", None),
        ("Files validated, moving job to queued state", {"kind": "job.queued", "status": "queued"}),
    ]


def test_without_a_seed_each_job_draws_its_own(tenant: Tenant, idle_broker: Waiting) -> None:
    train = _file(tenant)
    seeds = {_create(tenant, {"training_file": train}).seed for _ in range(12)}
    # drawn below 2**31: 12 draws all below 2**20 would happen once in 2**132
    assert len(seeds) == 12 and all(0 <= s < 2**31 for s in seeds) and max(seeds) >= 2**20


def test_integrations_are_stored(tenant: Tenant, idle_broker: Waiting) -> None:
    body = {"training_file": _file(tenant), "integrations": [{"type": "tensorboard"}]}
    assert _create(tenant, body).integrations == [{"type": "tensorboard"}]


def test_top_level_hyperparameters_are_supervised_ones(tenant: Tenant, idle_broker: Waiting) -> None:
    job = _create(tenant, {"training_file": _file(tenant), "hyperparameters": {"n_epochs": 3}})
    assert job.method["type"] == "supervised"
    assert job.method["supervised"]["hyperparameters"]["n_epochs"] == 3


def test_hyperparameters_in_both_places_are_refused(tenant: Tenant) -> None:
    error = _refused(
        tenant,
        {
            "training_file": _file(tenant),
            "hyperparameters": {"n_epochs": 1},
            "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2}}},
        },
    )
    assert isinstance(error, BadRequest)
    assert (error.message, error.param, error.code) == (
        "give hyperparameters inside 'method', not at the top level as well",
        "hyperparameters",
        "invalid_value",
    )


def test_a_model_this_server_does_not_have_is_refused(tenant: Tenant) -> None:
    error = _refused(tenant, {"training_file": _file(tenant), "model": "someone/else"})
    assert isinstance(error, BadRequest)
    assert (error.message, error.param, error.code) == (
        "model 'someone/else' is not a base model of this deployment; GET /v1/models lists them. An "
        "operator adds one with `tunehouse models add someone/else` (a hub id, with HF_TOKEN for a gated "
        "model, or a local folder)",
        "model",
        "model_not_available",
    )


def test_a_hub_model_is_accepted_when_the_operator_allows_it(tenant: Tenant, idle_broker: Waiting) -> None:
    settings = get_settings().model_copy(update={"allow_hub_models": True})
    assert (
        _create(tenant, {"training_file": _file(tenant), "model": "someone/else"}, settings).model
        == "someone/else"
    )


def _fine_tuned(
    tenant: Tenant, *, deleted: bool, method: str = "supervised", base: str = TINY_MODEL_NAME
) -> str:
    name = f"ft:{base}:{tenant.id}::{new_id('ftjob')}"
    job_id = new_id("ftjob")
    with session_scope() as session:
        stored = {"type": method, method: {"hyperparameters": {}}}
        session.add(job_row(tenant.id, "succeeded", id=job_id, method=stored, model=base))
        session.flush()
        session.add(
            Checkpoint(
                id=new_id("ftckpt"),
                job_id=job_id,
                step=4,
                fine_tuned_model_checkpoint=name,
                metrics={},
                blob_key="ckpt/x",
                bytes=1,
                is_final=True,
                deleted_at=7 if deleted else None,
            )
        )
    return name


def test_a_fine_tuned_model_trains_further_unless_deleted(tenant: Tenant, idle_broker: Waiting) -> None:
    live = _fine_tuned(tenant, deleted=False)
    assert _create(tenant, {"training_file": _file(tenant), "model": live}).model == live
    gone = _fine_tuned(tenant, deleted=True)
    error = _refused(tenant, {"training_file": _file(tenant), "model": gone})
    assert isinstance(error, NotFound)
    assert (error.message, error.param, error.code) == (
        f"model '{gone}' was deleted (DELETE /v1/models) and cannot be fine-tuned further",
        "model",
        "model_not_found",
    )
    unknown = f"ft:{TINY_MODEL_NAME}:{tenant.id}::ftjob-nothing"
    error = _refused(tenant, {"training_file": _file(tenant), "model": unknown})
    assert (error.param, error.code) == ("model", "model_not_available")


def test_a_second_integration_of_a_type_is_refused(tenant: Tenant) -> None:
    integrations = [{"type": "tensorboard"}, {"type": "tensorboard"}]
    error = _refused(tenant, {"training_file": _file(tenant), "integrations": integrations})
    assert (error.message, error.param, error.code) == (
        "integrations[1]: a second 'tensorboard' integration (one of each type)",
        "integrations[1].type",
        "invalid_value",
    )


@pytest.mark.parametrize("param", ["training_file", "validation_file"])
def test_files_are_checked_by_name(tenant: Tenant, param: str) -> None:
    good = _file(tenant)
    other = {"training_file": good} if param == "validation_file" else {}

    def refusal(file_id: str) -> tuple[str, str | None, str | None]:
        error = _refused(tenant, {**other, param: file_id})
        return error.message, error.param, error.code

    assert refusal("file-missing") == (f"{param}: no such file 'file-missing'", param, "invalid_file")
    foreign = _file(new_tenant("creation"))
    assert refusal(foreign) == (f"{param}: no such file '{foreign}'", param, "invalid_file")
    results = _file(tenant, purpose="fine-tune-results")
    assert refusal(results) == (
        f"{param}: file '{results}' has purpose 'fine-tune-results'; train on a file uploaded with purpose "
        "fine-tune",
        param,
        "invalid_file",
    )
    pairs = _file(tenant, fmt="preference")
    assert refusal(pairs) == (
        f"{param}: file '{pairs}' has format 'preference', but method 'supervised' needs one of: chat, "
        "prompt_completion, text",
        param,
        "invalid_file_format",
    )


def test_a_feature_the_architecture_cannot_take_is_refused(
    tenant: Tenant, idle_broker: Waiting, family_model: Callable[[str], Path]
) -> None:
    """trainers.architectures' refusals, from the model's config.json: an operator's registered model, a
    job's model fine-tuned from it and a Tinker checkpoint of it (tests/trainers/test_model_families.py:
    what trains, family by family)."""
    registry = {"oss": str(family_model("gpt-oss")), "moe": str(family_model("qwen3-moe"))}
    settings = get_settings().model_copy(update={"model_registry": registry})
    chats = _file(tenant)

    def job(model: str, **hp: Any) -> dict[str, Any]:
        method = {"type": "supervised", "supervised": {"hyperparameters": hp}}
        return {"training_file": chats, "model": model, "method": method}

    with session_scope() as session:
        saved = record_tinker_checkpoint(
            session,
            tenant_id=tenant.id,
            training_run_id="run:train:0",
            kind="weights",
            name="s1",
            base_model="oss",
            blob_key="tinker/x",
            size=1,
        ).fine_tuned_model
    param = "method.supervised.hyperparameters.packing"
    for model in ("oss", _fine_tuned(tenant, deleted=False, base="oss"), saved):
        error = _refused(tenant, job(model, packing=True), settings)
        assert (error.param, error.code) == (param, "invalid_value")
        assert error.message == (
            f"{param}: packing=True: gpt-oss models cannot train on packed rows (their attention masks "
            "ignore the packed sequences' bounds in transformers); set packing to false"
        )
    param = "method.supervised.hyperparameters.lora_dropout"
    error = _refused(tenant, job("moe", lora_dropout=0.1), settings)
    assert (error.param, error.code) == (param, "invalid_value")
    assert error.message == (
        f"{param}: lora_dropout=0.1: LoRA adapts the experts of Qwen3-MoE models, which takes no dropout "
        "(peft cannot apply it to fused expert weights); set lora_dropout to 0, or name "
        "lora_target_modules to leave the experts out"
    )
    # what they can take is stored: no packing, the experts left out of LoRA or no LoRA at all
    for body in (
        job("oss", packing=False),
        job("moe", lora_dropout=0.1, lora_target_modules=["q_proj"]),
        job("moe", lora_dropout=0.1, lora=False),
        job(TINY_MODEL_NAME, packing=True),  # Llama packs
    ):
        assert _create(tenant, body, settings).status == "queued"


CHECK = {
    "type": "string_check",
    "name": "yes",
    "operation": "eq",
    "input": "{{sample.output_text}}",
    "reference": "yes",
}


def test_a_hyperparameter_rule_between_fields_is_refused(tenant: Tenant) -> None:
    """A constraint between hyperparameters (``hyperparameter_problem``), checked once "auto" is resolved."""
    ppo = {"grader": CHECK, "hyperparameters": {"batch_size": 3, "num_mini_batches": 2}}
    error = _refused(
        tenant, {"training_file": _file(tenant, fmt="prompt_only"), "method": {"type": "ppo", "ppo": ppo}}
    )
    param = "method.ppo.hyperparameters.num_mini_batches"
    assert (error.param, error.code) == (param, "invalid_value")
    assert error.message == (
        f"{param}: num_mini_batches=2: must divide the rollout's prompts, "
        "batch_size * gradient_accumulation_steps"
    )


@pytest.mark.parametrize("method", ["supervised", "kto", "ppo"])
def test_quantization_needs_lora_and_no_fsdp(tenant: Tenant, method: str, idle_broker: Waiting) -> None:
    """A quantized base only carries an adapter (the registry's shared constraint, every method) and is
    not sharded; the refusals name the knob; a LoRA job with it is stored as asked."""
    fmt = {"supervised": "chat", "kto": "preference", "ppo": "prompt_only"}[method]
    body: dict[str, Any] = {"grader": CHECK} if method == "ppo" else {}
    training_file = _file(tenant, fmt=fmt)
    param = f"method.{method}.hyperparameters.quantization"

    def job(hp: dict[str, Any], **extra: Any) -> dict[str, Any]:
        spec = {"type": method, method: {**body, "hyperparameters": hp}}
        return {"training_file": training_file, "method": spec, **extra}

    error = _refused(tenant, job({"quantization": "nf4", "lora": False}))
    assert (error.param, error.code) == (param, "invalid_value")
    assert error.message == (
        f"{param}: quantization='nf4': needs lora: true (a quantized base stays frozen; only a LoRA "
        "adapter beside it trains)"
    )
    error = _refused(tenant, job({"quantization": "int8"}, resources={"gpus": 2, "strategy": "fsdp"}))
    assert (error.param, error.code) == (param, "invalid_value")
    assert error.message == f"{param}: quantization='int8': not with resources.strategy 'fsdp'; use 'ddp'"
    stored = _create(tenant, job({"quantization": "nf4"}, resources={"gpus": 2}))
    assert stored.method[method]["hyperparameters"]["quantization"] == "nf4"


def test_an_rl_job_keeps_its_checked_grader(tenant: Tenant, idle_broker: Waiting) -> None:
    job = _create(
        tenant,
        {
            "training_file": _file(tenant, fmt="prompt_only"),
            "method": {"type": "grpo", "grpo": {"grader": CHECK}},
        },
    )
    assert job.method["type"] == "grpo" and job.method["grpo"]["grader"]["name"] == "yes"
    bad = {**CHECK, "input": "{{sample.nothing}}"}
    error = _refused(
        tenant,
        {
            "training_file": _file(tenant, fmt="prompt_only"),
            "method": {"type": "grpo", "grpo": {"grader": bad}},
        },
    )
    assert error.param is not None and error.param.startswith("method.grpo.grader")


def test_a_score_model_grader_must_be_a_reward_model_of_the_tenant(
    tenant: Tenant, idle_broker: Waiting
) -> None:
    reward_model = _fine_tuned(tenant, deleted=False, method="reward_model")
    sft_model = _fine_tuned(tenant, deleted=False)

    def grpo(model: str) -> dict[str, Any]:
        grader = {"type": "score_model", "name": "rm", "model": model}
        return {
            "training_file": _file(tenant, fmt="prompt_only"),
            "method": {"type": "grpo", "grpo": {"grader": grader}},
        }

    assert _create(tenant, grpo(reward_model)).method["grpo"]["grader"]["model"] == reward_model
    for model in (sft_model, f"ft:{TINY_MODEL_NAME}:{tenant.id}::ftjob-none"):
        error = _refused(tenant, grpo(model))
        assert (error.message, error.param, error.code) == (
            f"score_model grader: '{model}' is not a reward model of this organization (train one with "
            "method 'reward_model' and use its fine_tuned_model)",
            "method.grpo.grader.model",
            "model_not_available",
        )
    other = new_tenant("creation")  # another organization's reward model is not this one's
    error = _refused(other, {**grpo(reward_model), "training_file": _file(other, fmt="prompt_only")})
    assert error.code == "model_not_available"


def test_a_multi_gpu_job_goes_to_its_pool_and_says_when_no_worker_fits(
    tenant: Tenant, idle_broker: Waiting
) -> None:
    job = _create(tenant, {"training_file": _file(tenant), "resources": {"gpus": 2}})
    assert (job.queue, job.resources) == (
        f"{IDLE_QUEUE}.gpus2",
        {"nodes": 1, "gpus_per_node": 2, "strategy": "ddp"},
    )
    with session_scope() as session:
        kinds = [
            e.data["kind"]
            for e in session.scalars(select(JobEvent).where(JobEvent.job_id == job.id))
            if e.data
        ]
    assert kinds == ["job.queued", "job.waiting_for_worker"]
    # a live 2-GPU worker of this pool: the next such job waits for it in silence
    with session_scope() as session:
        advertise(session, worker_id=new_id("worker"), queue=IDLE_QUEUE, gpus=2)
    fits = _create(tenant, {"training_file": _file(tenant), "resources": {"gpus": 2}})
    with session_scope() as session:
        kinds = [
            e.data["kind"]
            for e in session.scalars(select(JobEvent).where(JobEvent.job_id == fits.id))
            if e.data
        ]
    assert kinds == ["job.queued"]
    broker = redis.Redis.from_url(IDLE_BROKER)
    try:
        waiting = [
            json.loads(base64.b64decode(json.loads(m)["body"]))[0] for m in broker.lrange(job.queue, 0, -1)
        ]
        broker.delete(job.queue)
    finally:
        broker.close()
    assert [job.id] in waiting and [fits.id] in waiting and (RUN_JOB_TASK, [job.id]) not in idle_broker()


def test_with_the_broker_down_the_job_is_stored_and_marked_unsent(
    tenant: Tenant, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The send after commit fails: the job is kept, queued, with no `dispatched_at`, so the next
    reconciler pass sends it at once."""
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    app = service.queue.make_celery(Settings(broker_url=dead, data_dir=tmp_path))
    monkeypatch.setattr(service.queue, "get_celery", lambda: app)
    job = _create(tenant, {"training_file": _file(tenant)})
    with session_scope() as session:
        row = session.get(Job, job.id)
        assert row is not None
        assert (row.status, row.dispatched_at) == ("queued", None) and row.queued_at is not None


def test_a_python_grader_is_refused_unless_the_operator_allows_it(
    tenant: Tenant, idle_broker: Waiting
) -> None:
    grader = {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0\n"}
    body = {
        "training_file": _file(tenant, fmt="prompt_only"),
        "method": {"type": "grpo", "grpo": {"grader": grader}},
    }
    error = _refused(tenant, body, get_settings().model_copy(update={"allow_python_grader": False}))
    assert (error.message, error.param, error.code) == (
        "python graders are disabled on this deployment (the operator enables them with "
        "TUNEHOUSE_ALLOW_PYTHON_GRADER=1)",
        "method.grpo.grader.type",
        "python_grader_disabled",
    )
    allowed = get_settings().model_copy(update={"allow_python_grader": True})
    assert _create(tenant, body, allowed).method["grpo"]["grader"]["type"] == "python"


def test_multi_node_jobs_need_a_ray_cluster_and_stay_within_the_maximum(
    tenant: Tenant, idle_broker: Waiting
) -> None:
    """`resources.nodes` > 1 (service/jobs/resources.py): refused without TUNEHOUSE_RAY_ADDRESS or above
    the operator's maximum, nothing stored; accepted, it goes to the pool's Ray queue (worker/ray_driver.py
    runs it; tests/ray run it on a real cluster)."""
    body = {"training_file": _file(tenant), "resources": {"nodes": 2, "gpus_per_node": 4}}
    error = _refused(tenant, body)
    assert (error.status_code, error.param, error.code) == (400, "resources.nodes", "multi_node_unavailable")
    assert "TUNEHOUSE_RAY_ADDRESS" in error.message
    on_ray = Settings(job_queue=IDLE_QUEUE, ray_address="127.0.0.1:1", max_nodes=2)
    error = _refused(tenant, {**body, "resources": {"nodes": 3}}, on_ray)
    assert (error.param, error.code) == ("resources.nodes", "invalid_value")
    assert error.message == "resources.nodes: 3 is above this deployment's maximum of 2"
    error = _refused(tenant, {**body, "resources": {"gpus": 2, "gpus_per_node": 2}}, on_ray)
    assert (error.param, error.code) == ("resources.gpus", "invalid_value")
    job = _create(tenant, body, on_ray)
    assert (job.queue, job.resources) == (
        f"{IDLE_QUEUE}.ray",
        {"nodes": 2, "gpus_per_node": 4, "strategy": "ddp"},
    )
    # a one-node job's spelling, gpus_per_node, is the same job as `gpus`
    one = _create(tenant, {**body, "resources": {"gpus_per_node": 2}})
    assert (one.queue, one.resources) == (
        f"{IDLE_QUEUE}.gpus2",
        {"nodes": 1, "gpus_per_node": 2, "strategy": "ddp"},
    )
    broker = redis.Redis.from_url(IDLE_BROKER)
    broker.delete(job.queue, one.queue)
