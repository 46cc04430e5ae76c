"""The chat rows people fine-tune on in 2026 — tool definitions and calls, reasoning, multi-turn
conversations, legacy functions, text parts — through the real stack (uvicorn, a training worker, an
inference worker for the estimate, Redis, PostgreSQL) on a base whose tokenizer carries Qwen3's real
chat template (``tests.conftest.chat_model``): uploaded, previewed by the estimate as they will train,
trained (SFT and DPO), and refused with the line and field where the model's template cannot render
them. Before trainers/chat, these rows failed in training (content must be a string), trained an empty
turn in place of the call, or failed as a system fault ("does not render conversations incrementally")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.chat_rows import CALL, WEATHER
from tests.conftest import Stack, new_key
from tests.helpers import all_pages, upload_ok, wait_for

TOOL_ROW = {
    "tools": [WEATHER],
    "parallel_tool_calls": False,
    "messages": [
        {"role": "developer", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'},
        {"role": "assistant", "content": "It is 20 degrees."},
    ],
}
REASONING_ROW = {
    "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "today?"}],
        },
        {"role": "assistant", "content": "<think>\nNo tools here.\n</think>\n\nI cannot tell."},
    ]
}
LEGACY_ROW = {
    "functions": [WEATHER["function"]],
    "messages": [
        {"role": "user", "content": "And in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
        },
        {"role": "function", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "Sunny in Rome."},
    ],
}
ROWS = [TOOL_ROW, REASONING_ROW, LEGACY_ROW]


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=stack.url, headers={"Authorization": f"Bearer {new_key()}"}, timeout=120
    ) as client:
        yield client


def sft(model: str, file_id: str, **hp: Any) -> dict[str, Any]:
    hyperparameters = {
        "n_epochs": 1,
        "batch_size": 2,
        "max_length": 1024,
        "learning_rate_multiplier": 2.0,
        **hp,
    }
    return {
        "model": model,
        "training_file": file_id,
        "seed": 3,
        "method": {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}},
    }


def trained(preview: list[dict[str, Any]]) -> str:
    return "".join(s["text"] for s in preview if s["trained"])


def untrained(preview: list[dict[str, Any]]) -> str:
    return "".join(s["text"] for s in preview if not s["trained"])


def test_tool_calls_reasoning_and_turns_are_previewed_then_trained(
    http: httpx.Client, chat_model: str
) -> None:
    file_id = upload_ok(http, ROWS)
    answer = http.post("/v1/fine_tuning/jobs/estimate", json=sft(chat_model, file_id))
    assert answer.status_code == 200, answer.text
    estimate = answer.json()
    # Qwen3 writes a turn's <think> block only while it is the last: each of the 6 turns trains as a
    # sequence of its own, in the context it has at inference time
    assert (estimate["examples"], estimate["trained_examples"]) == (3, 6)
    call_turn, answer_turn = estimate["preview"][0], estimate["preview"][1]
    assert "The weather in a city" in untrained(call_turn)  # the tool's schema: in the prompt, untrained
    assert trained(call_turn) == (
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
    )
    assert '<tool_response>\n{"temp": 20}\n</tool_response>' in untrained(answer_turn)
    assert trained(answer_turn) == "<think>\n\n</think>\n\nIt is 20 degrees.<|im_end|>\n"
    assert trained(estimate["preview"][2]) == "<think>\nA greeting.\n</think>\n\nHello!<|im_end|>\n"

    created = http.post("/v1/fine_tuning/jobs", json=sft(chat_model, file_id))
    assert created.status_code == 200, created.text
    job = wait_for(http, created.json()["id"])
    assert job["status"] == "succeeded", job
    metrics = [
        r for r in all_pages(http, f"/v1/fine_tuning/jobs/{job['id']}/metrics") if "trained_tokens" in r
    ]
    assert metrics[-1]["trained_tokens"] == estimate["trained_tokens"]["total"]


def test_a_preference_job_trains_a_preferred_tool_call(http: httpx.Client, chat_model: str) -> None:
    pair = {
        "input": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]},
        "preferred_output": [{"role": "assistant", "content": None, "tool_calls": [CALL]}],
        "non_preferred_output": [{"role": "assistant", "content": "I cannot look that up."}],
    }
    file_id = upload_ok(http, [pair, pair])
    body = {
        "model": chat_model,
        "training_file": file_id,
        "method": {"type": "dpo", "dpo": {"hyperparameters": {"n_epochs": 1, "batch_size": 2}}},
    }
    preview = http.post("/v1/fine_tuning/jobs/estimate", json=body).json()["preview"]
    assert "<tool_call>" in trained(preview[0]) and "cannot look" in trained(preview[1])
    job = wait_for(http, http.post("/v1/fine_tuning/jobs", json=body).json()["id"])
    assert job["status"] == "succeeded", job


def test_rows_the_models_template_cannot_render_are_refused_with_line_and_field(http: httpx.Client) -> None:
    """The demo model's template writes only role and content: a tool call would train as an empty turn,
    so the estimate answers 400 and the job fails as the user's data, naming line 1's call."""
    file_id = upload_ok(http, [TOOL_ROW])
    body = sft("tunehouse/tiny-llama", file_id)
    answer = http.post("/v1/fine_tuning/jobs/estimate", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "training_file"
    assert (
        "line 1: field 'messages[2].tool_calls[0]': the model's chat template does not render tool calls"
        in (error["message"])
    )
    job = wait_for(http, http.post("/v1/fine_tuning/jobs", json=body).json()["id"])
    assert job["status"] == "failed"
    assert job["error"]["code"] == "invalid_training_data" and job["error"]["param"] == "training_file"
    assert job["error"]["message"].startswith("line 1: field 'messages[2].tool_calls[0]'")
