"""Jobs API: validation with named params, "auto" resolved and stored, lists, cancel, extensions.

Runs against the API-only server: its broker has no worker, so jobs stay queued.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import METRICS_TOKEN
from tests.e2e.test_preference_methods import preference_rows
from tests.helpers import chat_rows, upload_ok

MODEL = "tunehouse/tiny-llama"


@pytest.fixture
def train_file(client: httpx.Client) -> str:
    return upload_ok(client, chat_rows(40))


def _create(client: httpx.Client, **body: Any) -> httpx.Response:
    return client.post("/v1/fine_tuning/jobs", json=body)


def _error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def test_create_resolves_auto_and_returns_openai_shape(client: httpx.Client, train_file: str) -> None:
    response = _create(client, model=MODEL, training_file=train_file, suffix="exp1", metadata={"team": "a"})
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["object"] == "fine_tuning.job" and job["id"].startswith("ftjob-")
    assert job["status"] == "queued" and job["model"] == MODEL and job["user_provided_suffix"] == "exp1"
    hp = job["method"]["supervised"]["hyperparameters"]
    assert job["method"]["type"] == "supervised"
    # 40 examples: batch 40 // 8 = 5, epochs ceil(256 / 40) = 7, multiplier 1
    assert (hp["batch_size"], hp["n_epochs"], hp["learning_rate_multiplier"]) == (5, 7, 1.0)
    assert job["hyperparameters"] == {"n_epochs": 7, "batch_size": 5, "learning_rate_multiplier": 1.0}
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["method"] == job["method"]
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events").json()
    assert [e["message"] for e in events["data"]][-1].startswith("Validating training file")
    assert all(e["object"] == "fine_tuning.job.event" for e in events["data"])


def test_legacy_top_level_hyperparameters(client: httpx.Client, train_file: str) -> None:
    response = _create(client, model=MODEL, training_file=train_file, hyperparameters={"n_epochs": 2})
    assert response.status_code == 200, response.text
    assert response.json()["method"]["supervised"]["hyperparameters"]["n_epochs"] == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "no-such-model"}, "model"),
        ({"training_file": "file-doesnotexist"}, "training_file"),
        ({"validation_file": "file-doesnotexist"}, "validation_file"),
        (
            {"method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 0}}}},
            "method.supervised.hyperparameters.n_epochs",
        ),
        (
            {
                "method": {
                    "type": "supervised",
                    "supervised": {"hyperparameters": {"learning_rate_multiplier": -1}},
                }
            },
            "method.supervised.hyperparameters.learning_rate_multiplier",
        ),
        (
            {"method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": "big"}}}},
            "method.supervised.hyperparameters.batch_size",
        ),
        (
            {"method": {"type": "supervised", "supervised": {"hyperparameters": {"epochs": 3}}}},
            "method.supervised.hyperparameters.epochs",
        ),
        ({"surprise": True}, "surprise"),
        ({"method": {"type": "teleport"}}, "method.type"),
        ({"method": {"type": "grpo", "grpo": {}}}, "method.grpo.grader"),
        (
            {
                "method": {
                    "type": "grpo",
                    "grpo": {
                        "grader": {"type": "string_check", "operation": "is", "input": "x", "reference": "y"}
                    },
                }
            },
            "method.grpo.grader.operation",
        ),
        (
            {"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0}}}},
            "method.dpo.hyperparameters.beta",
        ),
        (
            {"method": {"type": "dpo", "dpo": {"hyperparameters": {"packing": True}}}},
            "method.dpo.hyperparameters.packing",
        ),
        (
            {"method": {"type": "supervised", "supervised": {"hyperparameters": {"quantization": "fp4"}}}},
            "method.supervised.hyperparameters.quantization",
        ),
        (
            {
                "method": {
                    "type": "supervised",
                    "supervised": {"hyperparameters": {"quantization": "nf4", "lora": False}},
                }
            },
            "method.supervised.hyperparameters.quantization",
        ),
        (
            {
                "method": {"type": "supervised", "supervised": {"hyperparameters": {"quantization": "int8"}}},
                "resources": {"gpus": 2, "strategy": "fsdp"},
            },
            "method.supervised.hyperparameters.quantization",
        ),
        ({"resources": {"gpus": 0}}, "resources.gpus"),
        ({"resources": {"gpus": 65}}, "resources.gpus"),
        ({"resources": {"gpus": "2"}}, "resources.gpus"),
        ({"resources": {"strategy": "zero3"}}, "resources.strategy"),
        ({"resources": {"gpu": 2}}, "resources.gpu"),
        ({"resources": {"nodes": 0}}, "resources.nodes"),
        ({"resources": {"nodes": 1025}}, "resources.nodes"),
        ({"resources": {"nodes": "2"}}, "resources.nodes"),
        ({"resources": {"nodes": 2}}, "resources.nodes"),  # no Ray cluster here (multi_node_unavailable)
        ({"resources": {"gpus_per_node": 0}}, "resources.gpus_per_node"),
        ({"resources": {"gpus_per_node": 65}}, "resources.gpus_per_node"),
        ({"resources": {"gpus_per_node": 1.5}}, "resources.gpus_per_node"),
        ({"suffix": "has spaces"}, "suffix"),
        ({"seed": -1}, "seed"),
        ({"method": {"type": "supervised"}, "hyperparameters": {"n_epochs": 1}}, "hyperparameters"),
    ],
)
def test_create_rejects_with_param(
    client: httpx.Client, train_file: str, body: dict[str, Any], param: str
) -> None:
    full = {"model": MODEL, "training_file": train_file, **body}
    error = _error(_create(client, **full))
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_file_format_must_fit_method(client: httpx.Client) -> None:
    preference = upload_ok(client, [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    error = _error(_create(client, model=MODEL, training_file=preference))
    assert error["param"] == "training_file" and error["code"] == "invalid_file_format"
    assert "preference" in error["message"]


def test_method_needs_matching_file_format(client: httpx.Client, train_file: str) -> None:
    for method in ("dpo", "reward_model"):
        error = _error(_create(client, model=MODEL, training_file=train_file, method={"type": method}))
        assert error["param"] == "training_file" and error["code"] == "invalid_file_format"
    preference = upload_ok(client, [{"prompt": "q", "chosen": "a", "rejected": "b"}] * 16)
    job = _create(client, model=MODEL, training_file=preference, method={"type": "dpo"}).json()
    assert job["method"]["dpo"]["hyperparameters"]["beta"] == 0.1
    assert job["method"]["dpo"]["hyperparameters"]["batch_size"] == 2


RL_PROMPTS = [{"prompt": "Say yes", "answer": "yes"}] * 8
CHECK = {
    "type": "string_check",
    "name": "yes",
    "operation": "ilike",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
}


def test_rl_methods_validate_graders(client: httpx.Client, train_file: str) -> None:
    prompts = upload_ok(client, RL_PROMPTS)
    for method_type in ("grpo", "reinforcement", "ppo"):
        ok = _create(
            client,
            model=MODEL,
            training_file=prompts,
            method={"type": method_type, method_type: {"grader": CHECK}},
        )
        assert ok.status_code == 200, ok.text
        assert ok.json()["method"][method_type]["grader"]["operation"] == "ilike"
        # a chat (SFT) file is the wrong format for RL
        error = _error(
            _create(
                client,
                model=MODEL,
                training_file=train_file,
                method={"type": method_type, method_type: {"grader": CHECK}},
            )
        )
        assert error["param"] == "training_file"

    python = {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0\n"}
    error = _error(
        _create(
            client, model=MODEL, training_file=prompts, method={"type": "grpo", "grpo": {"grader": python}}
        )
    )
    assert error["code"] == "python_grader_disabled" and error["param"] == "method.grpo.grader.type"

    score = {"type": "score_model", "name": "rm", "model": "ft:tunehouse/tiny-llama:x::ftjob-nope"}
    error = _error(
        _create(client, model=MODEL, training_file=prompts, method={"type": "ppo", "ppo": {"grader": score}})
    )
    assert error["param"] == "method.ppo.grader.model"

    multi = {"type": "multi", "graders": {"a": CHECK}, "calculate_output": "a + b"}
    error = _error(
        _create(
            client, model=MODEL, training_file=prompts, method={"type": "grpo", "grpo": {"grader": multi}}
        )
    )
    assert "calculate_output uses 'b', which is not a grader name" in error["message"]

    # RL jobs take a validation file of prompts (graded at eval_steps: valid_reward), not of chats
    job = _create(
        client,
        model=MODEL,
        training_file=prompts,
        validation_file=prompts,
        method={"type": "grpo", "grpo": {"grader": CHECK, "hyperparameters": {"eval_sampling": "sample"}}},
    )
    assert job.status_code == 200, job.text
    assert job.json()["validation_file"] == prompts
    assert job.json()["method"]["grpo"]["hyperparameters"]["eval_sampling"] == "sample"
    chats = upload_ok(client, chat_rows(4))
    error = _error(
        _create(
            client,
            model=MODEL,
            training_file=prompts,
            validation_file=chats,
            method={"type": "grpo", "grpo": {"grader": CHECK}},
        )
    )
    assert error["param"] == "validation_file" and error["code"] == "invalid_file_format"


def test_list_pagination_and_metadata_filter(client: httpx.Client, train_file: str) -> None:
    ids = []
    for i in range(4):
        response = _create(
            client, model=MODEL, training_file=train_file, metadata={"batch": "x" if i % 2 else "y"}
        )
        ids.append(response.json()["id"])
    page1 = client.get("/v1/fine_tuning/jobs", params={"limit": 3}).json()
    assert [j["id"] for j in page1["data"]] == ids[::-1][:3] and page1["has_more"]
    page2 = client.get("/v1/fine_tuning/jobs", params={"limit": 3, "after": page1["data"][-1]["id"]}).json()
    assert [j["id"] for j in page2["data"]] == ids[::-1][3:] and not page2["has_more"]
    filtered = client.get("/v1/fine_tuning/jobs", params={"metadata[batch]": "x"}).json()
    assert [j["id"] for j in filtered["data"]] == [ids[3], ids[1]]


def test_cancel_queued_job_then_conflict(client: httpx.Client, train_file: str) -> None:
    job_id = _create(client, model=MODEL, training_file=train_file).json()["id"]
    cancelled = client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["finished_at"] is not None
    again = _error(client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel"), 409)
    assert again["code"] == "job_not_cancellable"


def test_pause_resume_cancel_state_machine_on_a_queued_job(client: httpx.Client, train_file: str) -> None:
    """No worker listens to this server's broker, so the job stays queued: pausing it is immediate.
    (Pausing a running job, which checkpoints first, is tested in tests/e2e/test_job_recovery.py.)"""
    job_id = _create(client, model=MODEL, training_file=train_file).json()["id"]
    url = f"/v1/fine_tuning/jobs/{job_id}"
    not_paused = _error(client.post(f"{url}/resume"), 409)
    assert not_paused["code"] == "job_not_resumable" and not_paused["param"] == "fine_tuning_job_id"
    assert not_paused["message"].startswith(f"job {job_id} is queued; only a paused job can be resumed")

    paused = client.post(f"{url}/pause")
    assert paused.status_code == 200 and paused.json()["status"] == "paused"
    assert paused.json()["object"] == "fine_tuning.job" and paused.json()["finished_at"] is None
    twice = _error(client.post(f"{url}/pause"), 409)
    assert twice["code"] == "job_not_pausable"
    assert (
        f"is paused; only a queued or running job can be paused; resume it with POST {url}/resume"
        in (twice["message"])
    )
    resumed = client.post(f"{url}/resume")
    assert resumed.status_code == 200 and resumed.json()["status"] == "queued"

    assert client.post(f"{url}/pause").json()["status"] == "paused"
    cancelled = client.post(f"{url}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    for action, code in (("pause", "job_not_pausable"), ("resume", "job_not_resumable")):
        error = _error(client.post(f"{url}/{action}"), 409)
        assert error["code"] == code and f"job {job_id} has already cancelled" in error["message"]

    events = [e for e in client.get(f"{url}/events", params={"limit": 100}).json()["data"]][::-1]
    kinds = [e["data"]["kind"] for e in events if e["data"] and "kind" in e["data"]]
    assert kinds == ["job.queued", "job.paused", "job.resumed", "job.paused", "job.cancelled"]
    assert client.post("/v1/fine_tuning/jobs/ftjob-nope/pause").status_code == 404
    assert client.post("/v1/fine_tuning/jobs/ftjob-nope/resume").status_code == 404


def test_queue_position_follows_the_fair_order(client: httpx.Client, train_file: str, api_url: str) -> None:
    """Tenants take turns (service/jobs/fairness.py): another tenant's first job goes ahead of this
    tenant's second, though it was queued after it. Other tests' jobs wait in the same queue, so the
    positions are compared, not fixed."""
    from tests.conftest import new_key

    mine = [_create(client, model=MODEL, training_file=train_file).json() for _ in range(2)]
    with httpx.Client(
        base_url=api_url, headers={"Authorization": f"Bearer {new_key()}"}, timeout=60
    ) as other:
        theirs = _create(other, model=MODEL, training_file=upload_ok(other, chat_rows(40))).json()

        def position(job_id: str) -> int | None:
            return client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["queue_position"]

        first, second = position(mine[0]["id"]), position(mine[1]["id"])
        assert first is not None and second is not None and theirs["queue_position"] is not None
        assert first < theirs["queue_position"] < second
        listed = {j["id"]: j["queue_position"] for j in client.get("/v1/fine_tuning/jobs").json()["data"]}
        assert listed[mine[0]["id"]] == first and listed[mine[1]["id"]] == second
        cancelled = client.post(f"/v1/fine_tuning/jobs/{mine[0]['id']}/cancel").json()
        assert cancelled["queue_position"] is None
        # my second job is now my tenant's first turn, and it was queued before theirs
        now_second = position(mine[1]["id"])
        assert now_second is not None
        assert now_second < other.get(f"/v1/fine_tuning/jobs/{theirs['id']}").json()["queue_position"]


def test_unknown_job_is_404(client: httpx.Client) -> None:
    error = _error(client.get("/v1/fine_tuning/jobs/ftjob-nope"), 404)
    assert error["code"] == "job_not_found"


def test_empty_checkpoints_and_metrics(client: httpx.Client, train_file: str) -> None:
    job_id = _create(client, model=MODEL, training_file=train_file).json()["id"]
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json() == {
        "object": "list",
        "data": [],
        "has_more": False,
        "first_id": None,
        "last_id": None,
    }
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics").json() == {
        "object": "list",
        "data": [],
        "has_more": False,
    }


def test_models_list(client: httpx.Client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    tiny = next(m for m in body["data"] if m["id"] == MODEL)
    assert {k: tiny[k] for k in ("object", "owned_by", "architecture", "context_length", "modalities")} == {
        "object": "model",
        "owned_by": "tunehouse",
        "architecture": "LlamaForCausalLM",
        "context_length": 2048,
        "modalities": ["text"],
    }
    assert tiny["trainable"]["methods"][:2] == ["supervised", "dpo"] and tiny["trainable"]["lora"]
    assert tiny["chat_template"].startswith("{{ bos_token }}")
    assert client.get(f"/v1/models/{MODEL}").json() == tiny
    error = _error(client.get("/v1/models/tunehouse/tiny-lama"), 404)
    assert error["param"] == "model"
    # an unknown name says what it may have meant and how an operator adds a model
    assert "(did you mean 'tunehouse/tiny-llama'?)" in error["message"]
    assert "`tunehouse models add tunehouse/tiny-lama`" in error["message"]


def test_health_and_prometheus(api_url: str, api_key: str) -> None:
    assert httpx.get(f"{api_url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{api_url}/readyz").status_code == 200
    operator = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    metrics = httpx.get(f"{api_url}/metrics", headers=operator).text
    assert 'tunehouse_jobs{status="queued"}' in metrics
    # every tenant's counts: not for anonymous callers, nor for a tenant's API key
    for headers in ({}, {"Authorization": f"Bearer {api_key}"}, {"Authorization": "Bearer wrong"}):
        denied = httpx.get(f"{api_url}/metrics", headers=headers)
        assert denied.status_code == 401 and "tunehouse_jobs" not in denied.text
    assert httpx.get(f"{api_url}/healthz").headers["x-request-id"].startswith("req_")


WANDB = {"type": "wandb", "wandb": {"project": "tunehouse-tests", "tags": ["ci"]}}


def test_integrations_in_openai_shape_are_stored_and_returned(client: httpx.Client, train_file: str) -> None:
    integrations = [WANDB, {"type": "tensorboard"}]
    response = _create(client, model=MODEL, training_file=train_file, integrations=integrations)
    assert response.status_code == 200, response.text
    assert response.json()["integrations"] == integrations
    assert client.get(f"/v1/fine_tuning/jobs/{response.json()['id']}").json()["integrations"] == integrations
    plain = _create(client, model=MODEL, training_file=train_file)
    assert plain.json()["integrations"] == []


@pytest.mark.parametrize(
    ("integrations", "param"),
    [
        ([{"type": "slack"}], "integrations[0].type"),
        ([{"type": "wandb"}], "integrations[0]"),
        ([{"type": "wandb", "wandb": {}}], "integrations[0].wandb.project"),
        ([{"type": "wandb", "wandb": {"project": ""}}], "integrations[0].wandb.project"),
        ([{"type": "wandb", "wandb": {"project": "p", "tags": ["x" * 65]}}], "integrations[0].wandb.tags[0]"),
        ([{"type": "wandb", "wandb": {"project": "p", "team": "t"}}], "integrations[0].wandb.team"),
        ([{"type": "tensorboard", "wandb": {"project": "p"}}], "integrations[0]"),
        ([WANDB, WANDB], "integrations[1].type"),
        ({"type": "wandb"}, "integrations"),
    ],
)
def test_bad_integrations_are_a_400_naming_the_field(
    client: httpx.Client, train_file: str, integrations: Any, param: str
) -> None:
    before = client.get("/v1/fine_tuning/jobs").json()["data"]
    error = _error(_create(client, model=MODEL, training_file=train_file, integrations=integrations))
    assert error["param"] == param, error
    assert client.get("/v1/fine_tuning/jobs").json()["data"] == before  # nothing stored


def test_resources_default_to_one_gpu_and_state_the_global_batch(
    client: httpx.Client, train_file: str
) -> None:
    hp = {"batch_size": 3, "gradient_accumulation_steps": 2}
    one = _create(client, model=MODEL, training_file=train_file, method=_sft(hp)).json()
    one_gpu = {"nodes": 1, "gpus_per_node": 1, "gpus": 1, "strategy": "ddp", "global_batch_size": 6}
    assert one["resources"] == one_gpu
    four = _create(client, model=MODEL, training_file=train_file, method=_sft(hp), resources={"gpus": 4})
    assert four.status_code == 200, four.text
    job = four.json()
    assert job["resources"] == {**one_gpu, "gpus_per_node": 4, "gpus": 4, "global_batch_size": 24}
    assert job["status"] == "queued" and job["queue_position"] == 1
    # no worker of this pool has 4 GPUs (none runs at all): the job says why it waits
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events").json()["data"]
    waiting = [e for e in events if (e["data"] or {}).get("kind") == "job.waiting_for_worker"]
    assert [e["message"] for e in waiting] == [
        "Waiting for a worker with 4 GPUs: no training worker is running; "
        "the job stays queued until one joins"
    ]
    assert waiting[0]["data"] == {
        "kind": "job.waiting_for_worker",
        "status": "queued",
        "gpus": 4,
        "largest_worker_gpus": None,
    }
    # a one-GPU job is not checked: every worker holds it
    one_events = client.get(f"/v1/fine_tuning/jobs/{one['id']}/events").json()["data"]
    assert not [e for e in one_events if (e["data"] or {}).get("kind") == "job.waiting_for_worker"]


def _sft(hp: dict[str, Any]) -> dict[str, Any]:
    return {"type": "supervised", "supervised": {"hyperparameters": hp}}


@pytest.mark.parametrize("method", ["supervised", "dpo", "grpo", "ppo"])
def test_every_method_takes_several_gpus_and_fsdp(client: httpx.Client, method: str) -> None:
    online = method in ("grpo", "ppo")
    rows = RL_PROMPTS if online else (chat_rows(8) if method == "supervised" else preference_rows(4))
    body = {"type": method, method: {"grader": CHECK}} if online else {"type": method}
    training_file = upload_ok(client, rows)
    for resources in ({"gpus": 2}, {"gpus": 2, "strategy": "fsdp"}, {"strategy": "fsdp"}):
        response = _create(client, model=MODEL, training_file=training_file, method=body, resources=resources)
        assert response.status_code == 200, response.text
        assert response.json()["resources"]["strategy"] == resources.get("strategy", "ddp")


@pytest.mark.parametrize(
    ("method", "param", "hint"),
    [
        ({"type": "supervised", "supervised": {"hyperparameters": {"n_epoch": 2}}}, "n_epoch", "n_epochs"),
        (
            {"type": "grpo", "grpo": {"hyperparameters": {"num_generation": 4}}},
            "num_generation",
            "num_generations",
        ),
        ({"type": "grpoo"}, "method.type", "grpo"),
    ],
)
def test_a_mistyped_method_or_hyperparameter_says_what_it_may_mean(
    client: httpx.Client, train_file: str, method: dict[str, Any], param: str, hint: str
) -> None:
    error = _error(_create(client, model=MODEL, training_file=train_file, method=method))
    assert error["param"].endswith(param)
    assert error["message"].endswith(f" (did you mean '{hint}'?)"), error["message"]


def test_an_unlike_name_gets_no_suggestion(client: httpx.Client, train_file: str) -> None:
    method = {"type": "supervised", "supervised": {"hyperparameters": {"zzz": 1}}}
    error = _error(_create(client, model=MODEL, training_file=train_file, method=method))
    assert error["message"] == "unknown parameter 'method.supervised.hyperparameters.zzz'"
