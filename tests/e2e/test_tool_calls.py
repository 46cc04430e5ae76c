"""Trained, then served back: a tool-calling conversation trained on a base with Qwen3's real chat template
(``tests.conftest.chat_model``) through the stack, then asked over /v1/chat/completions with the official
``openai`` client. The reply comes back as OpenAI's: ``tool_calls`` (ids, arguments as a JSON string),
``reasoning_content`` split from the content, ``finish_reason: "tool_calls"``, streamed as OpenAI streams
them; the reply appended as the client got it, with the tool's result, is the next request; a named or
required ``tool_choice`` starts the call; legacy ``functions`` get a ``function_call``. A GRPO job from the
fine-tuned model reads the sampled calls with a grader on ``{{sample.output_tools[0].function.name}}``.

"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.chat_rows import CALL, WEATHER
from tests.conftest import Stack, new_key
from tests.helpers import all_pages, upload_ok, wait_for

ASK: Any = {"role": "user", "content": "Weather in Paris?"}
RESULT = '{"temp": 20}'
CALLING = {
    "tools": [WEATHER],
    "messages": [
        ASK,
        {"role": "assistant", "content": None, "reasoning_content": "Ask the tool.", "tool_calls": [CALL]},
    ],
}
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 64}


@pytest.fixture(scope="module")
def trained(stack: Stack, chat_model: str) -> Iterator[dict[str, Any]]:
    """The call memorised: a full fine-tune of 40 steps on it (the loss ends near 0.03)."""
    key = new_key()
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        hp = {
            "n_epochs": 5,
            "batch_size": 1,
            "learning_rate": 1e-2,
            "lr_scheduler": "constant",
            "lora": False,
            "max_length": 1024,
        }
        created = http.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": chat_model,
                "training_file": upload_ok(http, [CALLING] * 8),
                "seed": 0,
                "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
            },
        )
        assert created.status_code == 200, created.text
        job = wait_for(http, created.json()["id"])
        assert job["status"] == "succeeded", job
        yield {"key": key, "model": job["fine_tuned_model"], "http": http}


@pytest.fixture(scope="module")
def oai(stack: Stack, trained: dict[str, Any]) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=trained["key"], max_retries=0, timeout=120)
    yield client
    client.close()


def test_the_trained_call_comes_back_as_openai_tool_calls(
    oai: openai.OpenAI, trained: dict[str, Any]
) -> None:
    reply = oai.chat.completions.create(model=trained["model"], messages=[ASK], tools=[WEATHER], **GREEDY)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    message = choice.message
    assert message.content is None
    assert message.reasoning_content == "Ask the tool."
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    # streamed: the reasoning as it comes, the call whole in one delta, the same finish
    chunks = list(
        oai.chat.completions.create(
            model=trained["model"],
            messages=[ASK],
            tools=[WEATHER],
            stream=True,
            **GREEDY,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    assert "".join(reasoning) == "Ask the tool." and len(reasoning) > 1  # piece by piece
    calls = [t for d in deltas for t in d.tool_calls or ()]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id and calls[0].type == "function"
    assert calls[0].function is not None
    assert (calls[0].function.name, calls[0].function.arguments) == (
        call.function.name,
        call.function.arguments,
    )
    assert not any(d.content for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]
    # the client's own stream helper gathers the same message
    with oai.chat.completions.stream(
        model=trained["model"],
        messages=[ASK],
        tools=[WEATHER],
        **GREEDY,
    ) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.tool_calls is not None
    assert final.message.tool_calls[0].function.arguments == call.function.arguments

    # the reply sent back as the client got it, with the tool's result: rendered (the tool's result as
    # Qwen3's <tool_response>) and answered
    answer = oai.chat.completions.create(
        model=trained["model"],
        messages=[ASK, message, {"role": "tool", "tool_call_id": call.id, "content": RESULT}],
        tools=[WEATHER],
        **GREEDY,
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage is not None and answer.usage.prompt_tokens > reply.usage.prompt_tokens


def test_tool_choice_named_required_none_and_legacy_functions(
    oai: openai.OpenAI, trained: dict[str, Any], chat_model: str
) -> None:
    def ask(model: str, **extra: Any) -> Any:
        return oai.chat.completions.create(model=model, messages=[ASK], **GREEDY, **extra).choices[0]

    # legacy functions: the call as function_call
    legacy = ask(trained["model"], functions=[WEATHER["function"]], function_call="auto")
    assert legacy.finish_reason == "function_call" and legacy.message.tool_calls is None
    assert legacy.message.function_call.name == "get_weather"
    assert json.loads(legacy.message.function_call.arguments) == {"city": "Paris"}
    # "none": no tools in the prompt and no calls read (what the model writes is content)
    free = ask(trained["model"], tools=[WEATHER], tool_choice="none")
    assert free.message.tool_calls is None and free.finish_reason in ("stop", "length")

    # a named function or "required" starts the reply with the template's own opening of a call (Qwen3's
    # with its empty reasoning block), up to the arguments or up to the name; the untrained base's
    # continuation is no JSON, so the opening comes back as written, in the content
    named = ask(
        chat_model, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    assert named.message.content.startswith('<tool_call>\n{"name": "get_weather", "arguments": '), named
    required = ask(chat_model, tools=[WEATHER], tool_choice="required")
    assert required.message.content.startswith('<tool_call>\n{"name": "'), required
    assert not required.message.content.startswith('<tool_call>\n{"name": "get_weather"')
    assert named.message.tool_calls is None and getattr(named.message, "reasoning_content", None) is None


def test_what_the_model_s_template_cannot_serve_is_a_400(oai: openai.OpenAI) -> None:
    """The demo model's template renders no tools: a 400 naming the parameter that gave them, from the
    inference worker that rendered it (streamed or not)."""
    for stream, tools in ((False, {"tools": [WEATHER]}), (True, {"functions": [WEATHER["function"]]})):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(model="tunehouse/tiny-llama", messages=[ASK], stream=stream, **tools)
        assert caught.value.body["param"] == next(iter(tools)), caught.value.body
        assert "chat format (plain" in caught.value.body["message"]


def test_a_grpo_grader_reads_the_sampled_tool_calls(trained: dict[str, Any]) -> None:
    """RL from the fine-tuned model, the prompt with its tools: a grader on the sampled call's name
    scores the calls the model makes, one on another name scores none."""
    http: httpx.Client = trained["http"]
    name = "{{sample.output_tools[0].function.name}}"
    grader = {
        "type": "multi",
        "graders": {
            "right": {
                "type": "string_check",
                "name": "right",
                "operation": "eq",
                "input": name,
                "reference": "get_weather",
            },
            "wrong": {
                "type": "string_check",
                "name": "wrong",
                "operation": "eq",
                "input": name,
                "reference": "get_time",
            },
        },
        "calculate_output": "right - wrong",
    }
    hp = {
        "n_epochs": 1,
        "batch_size": 2,
        "num_generations": 2,
        "max_completion_length": 100,
        "learning_rate": 1e-6,
        # near-greedy: the trained call is the model's greedy answer (the test above), so every sample
        # makes it, whatever a busy machine's thread count does to the last bits of the logits
        "temperature": 0.05,
    }
    created = http.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": trained["model"],
            "training_file": upload_ok(http, [{"messages": [ASK], "tools": [WEATHER]}] * 2),
            "method": {"type": "grpo", "grpo": {"grader": grader, "hyperparameters": hp}},
        },
    )
    assert created.status_code == 200, created.text
    job = wait_for(http, created.json()["id"])
    assert job["status"] == "succeeded", job
    rows = [r for r in all_pages(http, f"/v1/fine_tuning/jobs/{job['id']}/metrics") if "reward" in r]
    assert rows and rows[-1]["reward"] > 0.5, rows
