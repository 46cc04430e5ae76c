"""/v1/chat/completions and /v1/completions at the API boundary, on real uvicorn servers: bad
parameters are 400s naming the parameter, unknown models 404s, and every missing dependency a 503
with Retry-After (broker down, Redis down, no inference worker answering). The generating path itself
is tested end to end in tests/e2e/test_inference.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from tests.conftest import IDLE_BROKER, IDLE_QUEUE, _stop, free_port, start_server

CHAT = {"model": "tunehouse/tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
TOOL_RESULT = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
BAD_ARGUMENTS = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),  # over TUNEHOUSE_INFERENCE_MAX_TOKENS
        ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"seed": "x"}, "seed"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"logprobs": True}, "logprobs"),  # not supported: refused, not ignored
        ({"model": ""}, "model"),
        # the chat row, read by trainers.chat.rows: each problem named where it is
        ({"messages": [{"role": "user", "content": "hi"}, TOOL_RESULT]}, "messages[1].role"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [BAD_ARGUMENTS]}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER], "functions": [WEATHER["function"]]}, "functions"),
        ({"tools": [WEATHER], "parallel_tool_calls": "perhaps"}, "parallel_tool_calls"),
        # tool_choice: OpenAI's values, with tools, naming one of them
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        ({"functions": [WEATHER["function"]], "function_call": {"name": "x"}}, "function_call.name"),
        ({"tools": [WEATHER], "tool_choice": "auto", "function_call": "auto"}, "function_call"),
    ],
)
def test_bad_chat_parameters_are_400s_naming_them(
    client: httpx.Client, change: dict[str, Any], param: str
) -> None:
    response = client.post("/v1/chat/completions", json={**CHAT, **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split("[")[0] in error["message"]


def test_bad_completion_parameters_are_400s(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json={"model": "tunehouse/tiny-llama", "prompt": 3})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    response = client.post(
        "/v1/completions", json={"model": "tunehouse/tiny-llama", "prompt": "a", "echo": True}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"


@pytest.mark.parametrize("model", ["nope/nothing", "ft:tunehouse/tiny-llama:x:y:ftjob-1", "ftckpt-123"])
def test_unknown_models_are_404s(client: httpx.Client, model: str) -> None:
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "a"})):
        response = client.post(path, json={**body, "model": model})
        assert response.status_code == 404, response.text
        assert response.json()["error"] == {
            "message": f"The model '{model}' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }


def _closed_port() -> int:
    return free_port()  # bound and released: nothing listens there


@pytest.fixture
def server() -> Iterator[Any]:
    procs = []

    def start(env: dict[str, str]) -> str:
        url, proc = start_server(env)
        procs.append(proc)
        return url

    yield start
    for proc in procs:
        _stop(proc)


def _post(url: str, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


def test_broker_down_is_503_with_retry_after(server: Any, api_key: str) -> None:
    url = server({"TUNEHOUSE_BROKER_URL": f"redis://127.0.0.1:{_closed_port()}/0"})
    response = _post(url, api_key, CHAT)
    assert response.status_code == 503 and response.headers["retry-after"] == "2"
    assert response.json()["error"]["code"] == "broker_unavailable"


def test_redis_down_is_503_with_retry_after(server: Any, api_key: str) -> None:
    url = server(
        {"TUNEHOUSE_BROKER_URL": IDLE_BROKER, "TUNEHOUSE_REDIS_URL": f"redis://127.0.0.1:{_closed_port()}/0"}
    )
    for body in (CHAT, {**CHAT, "stream": True}):
        response = _post(url, api_key, body)
        assert response.status_code == 503 and response.headers["retry-after"] == "2"
        assert response.json()["error"]["code"] == "redis_unavailable"


def test_no_inference_worker_is_503_and_the_request_waits_on_its_own_queue(server: Any, api_key: str) -> None:
    broker = redis.Redis.from_url(IDLE_BROKER)
    broker.delete("tunehouse.inference")
    training_before = broker.llen(IDLE_QUEUE)
    url = server({"TUNEHOUSE_BROKER_URL": IDLE_BROKER, "TUNEHOUSE_INFERENCE_TIMEOUT_SECONDS": "2"})
    for body in (CHAT, {**CHAT, "stream": True}):
        response = _post(url, api_key, body)
        assert response.status_code == 503 and response.headers["retry-after"] == "2"
        error = response.json()["error"]
        assert error["code"] == "no_inference_worker" and "tunehouse worker --inference" in error["message"]
    # sent to the inference queue, which training workers do not consume, and never to theirs
    waiting = [json.loads(raw) for raw in broker.lrange("tunehouse.inference", 0, -1)]
    assert [m["headers"]["task"] for m in waiting] == ["tunehouse.infer"] * 2
    assert all(m["headers"]["expires"] for m in waiting)  # dropped unserved once nobody waits
    assert broker.llen(IDLE_QUEUE) == training_before
    broker.close()
