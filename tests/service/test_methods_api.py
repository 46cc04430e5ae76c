"""GET /v1/methods: every method of the registry with its hyperparameters' JSON Schema, taken from the
same pydantic models that validate job creation (so the dashboard's form cannot drift from the API)."""

from __future__ import annotations

import httpx

from service.jobs.spec import BODIES
from trainers.registry import METHODS


def test_methods_need_a_key(api_url: str) -> None:
    response = httpx.get(f"{api_url}/v1/methods")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "missing_api_key"


def test_methods_list_schema_defaults_ranges_and_graders(client: httpx.Client) -> None:
    body = client.get("/v1/methods").json()
    assert body["object"] == "list"
    methods = {m["id"]: m for m in body["data"]}
    assert list(methods) == list(METHODS)

    supervised = methods["supervised"]
    assert supervised["grader"] is False
    assert supervised["file_formats"] == ["chat", "prompt_completion", "text"]
    schema = BODIES["supervised"].model_fields["hyperparameters"].annotation.model_json_schema()  # type: ignore[union-attr]
    for name, prop in supervised["hyperparameters"]["properties"].items():
        assert prop == {**schema["properties"][name], "description": prop["description"]}, name
        assert prop["description"], name
    assert "mean_token_accuracy" in supervised["metrics"]
    n_epochs = supervised["hyperparameters"]["properties"]["n_epochs"]
    assert n_epochs["default"] == "auto"
    assert {"type": "integer", "minimum": 1, "maximum": 100} in n_epochs["anyOf"]

    for rl in ("grpo", "reinforcement", "ppo"):
        assert methods[rl]["grader"] is True, rl
    assert methods["dpo"]["grader"] is False and methods["reward_model"]["grader"] is False
    assert "reward" in methods["grpo"]["metrics"] and "kl" in methods["grpo"]["metrics"]
    assert methods["grpo"]["hyperparameters"]["properties"]["num_generations"]["minimum"] == 2
