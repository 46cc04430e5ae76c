"""service/inference/chat.py: what a chat request asks of the worker — the messages and tools as templates
read them, the tool choice (OpenAI's default: auto with tools, none without), one call per reply where
``parallel_tool_calls`` is false or the legacy ``functions`` are used — and the shapes of the reply
(service/inference/responses.py) the official client reads. The 400s are in test_inference_api.py."""

from __future__ import annotations

from typing import Any

import pytest

from service.inference.chat import read_request
from service.inference.responses import Choice, Shape
from service.inference.schemas import ChatCompletionRequest

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ASK = {"role": "user", "content": "Weather?"}


def request(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [ASK], **body})


@pytest.mark.parametrize(
    ("body", "choice", "name", "single", "legacy"),
    [
        ({}, "none", None, False, False),
        ({"tools": [WEATHER]}, "auto", None, False, False),
        ({"tools": [WEATHER], "parallel_tool_calls": False}, "auto", None, True, False),
        ({"tools": [WEATHER], "tool_choice": "required"}, "required", None, False, False),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            "function",
            "get_weather",
            False,
            False,
        ),
        ({"functions": [WEATHER["function"]]}, "auto", None, True, True),
        (
            {"functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}},
            "function",
            "get_weather",
            True,
            True,
        ),
        ({"functions": [WEATHER["function"]], "function_call": "none"}, "none", None, True, True),
    ],
)
def test_what_the_request_asks_of_the_worker(
    body: dict[str, Any], choice: str, name: str | None, single: bool, legacy: bool
) -> None:
    chat = read_request(request(**body))
    assert (chat.tool_choice, chat.tool_name, chat.single_tool_call, chat.legacy_functions) == (
        choice,
        name,
        single,
        legacy,
    )
    assert chat.tools == ([WEATHER] if "tools" in body or "functions" in body else None)


def test_messages_are_read_as_templates_read_them() -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    chat = read_request(
        request(
            tools=[WEATHER],
            messages=[
                {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                ASK,
                # a reply appended as the client got it: content null, refusal null, reasoning beside
                {
                    "role": "assistant",
                    "content": None,
                    "refusal": None,
                    "reasoning_content": "Hm.",
                    "tool_calls": [call],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
        )
    )
    system, _, assistant, tool = chat.messages
    assert system == {"role": "system", "content": "Be brief."}
    assert assistant["content"] == "" and assistant["reasoning_content"] == "Hm."
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"}


CALL = {"index": 0, "id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_a_reply_with_a_call_in_openai_s_shapes() -> None:
    choice = Choice()
    for piece in ({"reasoning_content": "Hm."}, {"tool_call": CALL}):
        choice.add(piece, None)
    choice.add(None, "tool_calls")
    shape = Shape(True, "chatcmpl-1", 0, "m")
    message = shape.completion([choice], {})["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"] == {
        "role": "assistant",
        "content": None,  # null beside the calls: the model wrote none
        "refusal": None,
        "reasoning_content": "Hm.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    assert shape.chunk(0, {"tool_call": CALL}, None)["choices"][0]["delta"] == {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ]
    }
    # the legacy functions: one function_call, finish_reason function_call
    legacy = Shape(True, "chatcmpl-1", 0, "m", functions=True)
    answered = legacy.completion([choice], {})["choices"][0]
    assert answered["finish_reason"] == "function_call" and "tool_calls" not in answered["message"]
    assert answered["message"]["function_call"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert legacy.chunk(0, {"tool_call": CALL}, None)["choices"][0]["delta"] == {
        "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    }
    assert legacy.chunk(0, None, "tool_calls")["choices"][0]["finish_reason"] == "function_call"
    # a reply without calls keeps its (possibly empty) content
    plain = Choice()
    plain.add(None, "stop")
    assert shape.completion([plain], {})["choices"][0]["message"]["content"] == ""
