"""trainers/chat/rows.py: OpenAI's chat row read into the messages chat templates read, each problem named
by its field. The upload validator's own tests (tests/service/test_file_validation.py) check the same
reader through a file; these check what it hands the templates."""

from __future__ import annotations

from typing import Any

import pytest

from tests.chat_rows import WEATHER
from trainers.chat.pairs import preference_pair, unpaired_example
from trainers.chat.rows import REASONING_KEYS, RowProblem, read_chat


def call(name: str = "get_weather", arguments: Any = '{"city": "Paris"}', **extra: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}, **extra}


def user(text: str = "Weather in Paris?") -> dict[str, Any]:
    return {"role": "user", "content": text}


def problem(messages: Any, **row: Any) -> RowProblem:
    with pytest.raises(RowProblem) as info:
        read_chat(messages, "messages", tools_from=row)
    return info.value


def test_a_tool_call_row_reads_as_templates_read_it() -> None:
    chat = read_chat(
        [
            {
                "role": "developer",
                "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            },
            user(),
            {"role": "assistant", "content": None, "tool_calls": [call(id="c1")]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'},
            {"role": "assistant", "content": "20 degrees.", "weight": 0},
        ],
        "messages",
        tools_from={"tools": [WEATHER], "parallel_tool_calls": False},
    )
    assert chat.messages == [
        {"role": "system", "content": "Be brief."},
        user(),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temp": 20}', "tool_call_id": "c1", "name": "get_weather"},
        {"role": "assistant", "content": "20 degrees."},
    ]
    assert chat.weights == [0, 0, 1, 0, 0]
    assert chat.paths == [f"messages[{i}]" for i in range(5)]
    assert chat.tools == [WEATHER] and chat.parallel_tool_calls is False
    assert chat.template_kwargs() == {"tools": [WEATHER]}
    # keys a message lacks are left out: gpt-oss and Llama 3.1 test `"tool_calls" in message`
    assert "tool_calls" not in chat.messages[4] and not set(REASONING_KEYS) & set(chat.messages[4])


def test_legacy_functions_become_tools_and_their_calls_and_results() -> None:
    chat = read_chat(
        [
            user(),
            {
                "role": "assistant",
                "content": None,
                "function_call": {"name": "get_weather", "arguments": "{}"},
            },
            {"role": "function", "name": "get_weather", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
        ],
        "messages",
        tools_from={"functions": [WEATHER["function"]]},
    )
    assert chat.tools == [WEATHER]
    [made] = chat.messages[1]["tool_calls"]
    assert made == {
        "id": "call_1_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {}},
    }
    assert chat.messages[2] == {
        "role": "tool",
        "content": "sunny",
        "tool_call_id": "call_1_0",
        "name": "get_weather",
    }


@pytest.mark.parametrize("key", REASONING_KEYS)
def test_reasoning_is_given_under_every_name_templates_read(key: str) -> None:
    chat = read_chat([user(), {"role": "assistant", "content": "Sunny.", key: "Look it up."}], "messages")
    assert {k: chat.messages[1][k] for k in REASONING_KEYS} == dict.fromkeys(REASONING_KEYS, "Look it up.")


def test_a_leading_think_block_is_the_reasoning() -> None:
    chat = read_chat(
        [user(), {"role": "assistant", "content": "<think>\nHmm.\n</think>\n\nSunny."}], "messages"
    )
    assert chat.messages[1]["content"] == "Sunny." and chat.messages[1]["reasoning_content"] == "Hmm."
    # a think block later in the text is the answer's own
    chat = read_chat([user(), {"role": "assistant", "content": "Say <think> and </think>."}], "messages")
    assert (
        chat.messages[1]["content"] == "Say <think> and </think>."
        and "reasoning_content" not in chat.messages[1]
    )


def test_tool_results_answer_the_calls_in_order_without_ids() -> None:
    calls = [call(arguments="{}"), call(name="get_time", arguments="{}")]
    chat = read_chat(
        [
            user(),
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "sunny"},
            {"role": "tool", "content": "noon"},
            {"role": "assistant", "content": "Sunny at noon."},
        ],
        "messages",
    )
    assert [(m["tool_call_id"], m["name"]) for m in chat.messages[2:4]] == [
        ("call_1_0", "get_weather"),
        ("call_1_1", "get_time"),
    ]


@pytest.mark.parametrize(
    ("messages", "row", "field", "words"),
    [
        (
            [user(), {"role": "assistant", "tool_calls": [call(arguments="[1]")]}],
            {},
            "messages[1].tool_calls[0].function.arguments",
            "must be a JSON object, got array",
        ),
        (
            [user(), {"role": "assistant", "tool_calls": [call(arguments="{")]}],
            {},
            "messages[1].tool_calls[0].function.arguments",
            "not valid JSON",
        ),
        (
            [user(), {"role": "assistant", "tool_calls": [call(name="other")]}],
            {"tools": [WEATHER]},
            "messages[1].tool_calls[0].function.name",
            "not one of the row's tools (get_weather)",
        ),
        (
            [user(), {"role": "assistant", "tool_calls": [call(), call()]}],
            {"parallel_tool_calls": False},
            "messages[1].tool_calls",
            "parallel_tool_calls is false",
        ),
        (
            [user(), {"role": "tool", "content": "x"}],
            {},
            "messages[1].role",
            "needs an earlier assistant message that calls a tool",
        ),
        (
            [
                user(),
                {"role": "assistant", "tool_calls": [call(id="a")]},
                {"role": "tool", "tool_call_id": "b", "content": "x"},
            ],
            {},
            "messages[2].tool_call_id",
            "no earlier tool call has the id 'b'",
        ),
        (
            [user(), {"role": "assistant", "content": "x", "reasoning": "a", "thinking": "b"}],
            {},
            "messages[1].thinking",
            "give the reasoning once",
        ),
        (
            [{"role": "user", "content": "x", "reasoning_content": "r"}],
            {},
            "messages[0].reasoning_content",
            "only an assistant message",
        ),
        (
            [user(), {"role": "assistant", "content": "<think>r</think>x", "reasoning": "r"}],
            {},
            "messages[1].content",
            "reasoning too",
        ),
        (
            [{"role": "user", "content": "x", "weight": 1}],
            {},
            "messages[0].weight",
            "only an assistant message has a weight",
        ),
        (
            [user(), {"role": "assistant", "tool_calls": [call()], "function_call": {"name": "x"}}],
            {},
            "messages[1].function_call",
            "not both",
        ),
        ([user()], {"tools": [WEATHER], "functions": [WEATHER["function"]]}, "functions", "not both"),
        ([user()], {"tools": [WEATHER, WEATHER]}, "tools[1]", "a second function named 'get_weather'"),
        (
            [user()],
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "tools[0].function.name",
            "letters, digits",
        ),
        ([user()], {"tools": [{"type": "retrieval"}]}, "tools[0].type", "unsupported tool type 'retrieval'"),
        ([user()], {"parallel_tool_calls": "yes"}, "parallel_tool_calls", "expected true or false"),
        (
            [user(), {"role": "function", "name": "get_weather", "content": "x"}],
            {},
            "messages[1].role",
            "needs an earlier",
        ),
    ],
)
def test_problems_name_their_field(messages: Any, row: dict[str, Any], field: str, words: str) -> None:
    found = problem(messages, **row)
    assert found.field == field and words in found.message


def test_a_preference_pair_continues_its_prompt_with_its_tools() -> None:
    row = {
        "input": {"messages": [user()], "tools": [WEATHER]},
        "preferred_output": [{"role": "assistant", "content": None, "tool_calls": [call()]}],
        "non_preferred_output": [{"role": "assistant", "content": "I cannot tell."}],
    }
    read = preference_pair(row, openai_shape=True)
    assert read is not None
    prompt, (chosen, rejected) = read
    assert prompt.weights == [0] and prompt.tools == [WEATHER]
    assert chosen.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert chosen.paths == ["input.messages[0]", "preferred_output[0]"]
    assert rejected.messages[1]["content"] == "I cannot tell."
    with pytest.raises(RowProblem, match="not one of the row's tools"):
        bad_call = [{"role": "assistant", "tool_calls": [call(name="other")]}]
        preference_pair({**row, "non_preferred_output": bad_call}, openai_shape=True)
    assert preference_pair({"prompt": "p", "chosen": "a", "rejected": "b"}, openai_shape=False) is None


def test_a_feedback_conversation_names_its_last_message() -> None:
    row = {
        "messages": [user(), {"role": "assistant", "content": None, "tool_calls": [call(arguments=3)]}],
        "label": True,
    }
    with pytest.raises(RowProblem) as info:
        unpaired_example(row, messages_shape=True)
    assert info.value.field == "messages[1].tool_calls[0].function.arguments"
