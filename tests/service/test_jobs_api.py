"""Jobs API: validation with named params, "auto" resolved and stored, lists, cancel, extensions.

Runs against the API-only server: its broker has no worker, so jobs stay queued.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

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
            "method.grpo.grader.string_check.operation",
        ),
        (
            {"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0}}}},
            "method.dpo.hyperparameters.beta",
        ),
        (
            {"method": {"type": "dpo", "dpo": {"hyperparameters": {"packing": True}}}},
            "method.dpo.hyperparameters.packing",
        ),
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
    assert "calculate_output names 'b'" in error["message"]

    error = _error(
        _create(
            client,
            model=MODEL,
            training_file=prompts,
            validation_file=prompts,
            method={"type": "grpo", "grpo": {"grader": CHECK}},
        )
    )
    assert error["param"] == "validation_file"


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


def test_pause_and_resume_say_not_implemented(client: httpx.Client, train_file: str) -> None:
    job_id = _create(client, model=MODEL, training_file=train_file).json()["id"]
    for action in ("pause", "resume"):
        error = _error(client.post(f"/v1/fine_tuning/jobs/{job_id}/{action}"))
        assert error["code"] == "not_implemented"
    assert client.post("/v1/fine_tuning/jobs/ftjob-nope/pause").status_code == 404


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
    assert {
        "id": MODEL,
        "object": "model",
        "created": body["data"][0]["created"],
        "owned_by": "tunehouse",
    } in body["data"]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert _error(client.get("/v1/models/nope"), 404)["param"] == "model"


def test_health_and_prometheus(api_url: str) -> None:
    assert httpx.get(f"{api_url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{api_url}/readyz").status_code == 200
    metrics = httpx.get(f"{api_url}/metrics").text
    assert 'tunehouse_jobs{status="queued"}' in metrics
    assert httpx.get(f"{api_url}/healthz").headers["x-request-id"].startswith("req_")
