"""trainers/data/chat_prompt.py on the families' own templates (tests.model_families): a chat completion's
prompt with its tools, the opening a forced ``tool_choice`` starts the reply with — the template's own
text for a call, which with the rest of the call the template writes reads back as that call — and the
400s (``ChatDataError`` naming the request's parameter) for what a template cannot serve."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tests.chat_rows import CALL, WEATHER
from tests.model_families import family_tokenizer
from trainers.chat.formats import ToolCall
from trainers.chat.rows import read_chat
from trainers.data.chat import ChatDataError, render
from trainers.data.chat_prompt import chat_prompt

ASK = {"role": "user", "content": "Weather in Paris?"}


def conversation(*messages: dict[str, Any], tools: bool = True) -> Any:
    chat = read_chat([ASK, *messages], "messages", tools_from={"tools": [WEATHER]} if tools else {})
    chat.weights = [0] * len(chat.weights)
    return chat


@pytest.mark.parametrize(
    ("family", "named", "required"),
    [
        (
            "qwen3",
            '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": ',
            '<tool_call>\n{"name": "',
        ),
        ("qwen2.5", '<tool_call>\n{"name": "get_weather", "arguments": ', '<tool_call>\n{"name": "'),
        ("llama3.1", '{"name": "get_weather", "parameters": ', '{"name": "'),
        ("gpt-oss", " to=functions.get_weather<|channel|>commentary json<|message|>", " to=functions."),
    ],
)
def test_a_forced_tool_choice_opens_the_call_as_the_template_writes_it(
    family: str, named: str, required: str
) -> None:
    tokenizer = family_tokenizer(family)
    chat = conversation()
    auto = chat_prompt(tokenizer, chat)
    assert auto.prefill == "" and auto.tool_calls and "The weather in a city" in auto.text

    forced = chat_prompt(tokenizer, chat, tool_choice="function", function="get_weather")
    assert forced.prefill == named and forced.text == auto.text + named
    anyone = chat_prompt(tokenizer, chat, tool_choice="required")
    assert anyone.prefill.endswith(required) and anyone.text == auto.text + anyone.prefill

    # the rest of the call as the template renders it, read after the opening: the call
    called = render(
        tokenizer, conversation({"role": "assistant", "tool_calls": [CALL]}), 2, generation_prompt=False
    )
    rest = called[len(forced.text) :]
    assert called.startswith(forced.text)
    for end in ("<|im_end|>\n", "<|eot_id|>"):  # the turn's EOS, which the model stops on
        rest = rest.removesuffix(end)
    reply = forced.format.parse(forced.prefill + rest, auto.text)
    assert reply.tool_calls == [ToolCall("get_weather", '{"city": "Paris"}')]
    assert reply.content == "" and reply.reasoning_content is None


def test_tool_choice_none_renders_no_tools_and_reads_no_calls() -> None:
    tokenizer = family_tokenizer("qwen3")
    chat = conversation()
    none = chat_prompt(tokenizer, chat, tool_choice="none")
    assert "get_weather" not in none.text and not none.tool_calls
    assert none.text == chat_prompt(tokenizer, replace(chat, tools=None)).text
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    reader = none.format.reader(none.text, tool_calls=none.tool_calls)
    assert [d.content for d in [*reader.feed(text), *reader.close()]] == [text]


@pytest.mark.parametrize(
    ("family", "choice", "param", "says"),
    [
        ("gemma3", "auto", "tools", "not read back from this model's chat format (plain"),
        ("phi3.5", "required", "tools", "not read back from this model's chat format (plain"),
    ],
)
def test_what_a_template_cannot_serve_is_refused_naming_the_parameter(
    family: str, choice: Any, param: str, says: str
) -> None:
    with pytest.raises(ChatDataError) as caught:
        chat_prompt(family_tokenizer(family), conversation(), tool_choice=choice)
    assert caught.value.field == param and says in str(caught.value)


def test_a_template_that_renders_no_tools_is_refused_naming_tools() -> None:
    """Llama 3.1's template puts the tools in the first user message: a conversation without one
    cannot carry them (the template raises); the refusal names the message it refuses."""
    tokenizer = family_tokenizer("llama3.1")
    chat = read_chat([{"role": "system", "content": "Hi"}], "messages", tools_from={"tools": [WEATHER]})
    with pytest.raises(ChatDataError) as caught:
        chat_prompt(tokenizer, chat)
    assert caught.value.field == "messages[0]"
