"""trainers/chat/formats.py, each format held to its family's own template (TRL's copy, with the family's
special tokens: tests.model_families): an assistant message with reasoning and tool calls is rendered by
the template, cut where the model would stop (its generation EOS), decoded as the inference worker
decodes it (``marker_decoder``: special tokens dropped but the format's markers) and read back into the
same content, reasoning and calls — whole, streamed token by token, and streamed one character at a
time. Markup that does not parse stays in the content as written."""

from __future__ import annotations

import doctest
import json
from typing import Any

import pytest

import trainers.chat.formats
from tests.chat_rows import WEATHER
from tests.model_families import FAMILIES, family_tokenizer
from trainers.chat.formats import FORMATS, Delta, Reply, ToolCall, detect_format
from trainers.chat.rows import read_chat
from trainers.data.chat import render
from trainers.modeling.generation import marker_decoder


def test_doctests_pass() -> None:
    assert doctest.testmod(trainers.chat.formats).failed == 0


def call(city: str, **extra: Any) -> dict[str, Any]:
    arguments = json.dumps({"city": city, **extra})
    return {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def expected_call(city: str, **extra: Any) -> ToolCall:
    return ToolCall("get_weather", json.dumps({"city": city, **extra}))


@pytest.mark.parametrize(
    ("family", "name"),
    [
        ("llama3.1", "llama3_json"),
        ("qwen2.5", "hermes"),
        ("qwen3", "hermes"),
        ("qwen3-moe", "hermes"),
        ("gemma3", "plain"),
        ("mistral", "plain"),
        ("phi3.5", "plain"),
        ("gpt-oss", "harmony"),
    ],
)
def test_each_family_s_template_is_detected_as_its_format(family: str, name: str) -> None:
    assert detect_format(FAMILIES[family].chat_template()).name == name
    assert FORMATS[name].name == name  # chosen by name too


def streamed(fmt_name: str, pieces: list[str], prompt: str) -> Reply:
    reader, reply = FORMATS[fmt_name].reader(prompt), Reply()
    for piece in pieces:
        for delta in reader.feed(piece):
            reply.add(delta)
    for delta in reader.close():
        reply.add(delta)
    return reply


# (family, the assistant message, what reads back: content, reasoning, calls). What a template does not
# render does not come back: Qwen2.5 renders no reasoning, Llama 3.1 no content beside a call (and one
# call only), gpt-oss's content beside a call is its analysis (reasoning)
CASES = [
    (
        "qwen3",
        {
            "content": "Let me check.",
            "reasoning_content": "Two cities.",
            "tool_calls": [call("Paris"), call("Rome")],
        },
        Reply("Let me check.", "Two cities.", [expected_call("Paris"), expected_call("Rome")]),
    ),
    (
        "qwen3",
        {"content": "It is 20 degrees.\n\nEnjoy.", "reasoning_content": "Read the tool.\nAnswer."},
        Reply("It is 20 degrees.\n\nEnjoy.", "Read the tool.\nAnswer.", []),
    ),
    (
        "qwen3",
        {"content": None, "tool_calls": [call("Paris", days=3)]},
        Reply("", None, [expected_call("Paris", days=3)]),
    ),
    (
        "qwen2.5",
        {"content": "Checking.", "tool_calls": [call("Paris"), call("Rome")]},
        Reply("Checking.", None, [expected_call("Paris"), expected_call("Rome")]),
    ),
    ("qwen2.5", {"content": "It is sunny."}, Reply("It is sunny.", None, [])),
    # the template's one newline before a call goes; the content's own stays
    (
        "qwen2.5",
        {"content": "Checking:\n", "tool_calls": [call("Paris")]},
        Reply("Checking:\n", None, [expected_call("Paris")]),
    ),
    ("llama3.1", {"content": None, "tool_calls": [call("Paris")]}, Reply("", None, [expected_call("Paris")])),
    ("llama3.1", {"content": "It is sunny."}, Reply("It is sunny.", None, [])),
    (
        "gpt-oss",
        {"content": None, "reasoning_content": "Need the weather.", "tool_calls": [call("Paris")]},
        Reply("", "Need the weather.", [expected_call("Paris")]),
    ),
    (
        "gpt-oss",
        {"content": "It is 20 degrees.", "reasoning_content": "Easy."},
        Reply("It is 20 degrees.", "Easy.", []),
    ),
    ("gemma3", {"content": "It is sunny."}, Reply("It is sunny.", None, [])),
    ("phi3.5", {"content": "It is sunny."}, Reply("It is sunny.", None, [])),
]


@pytest.mark.parametrize(("family", "message", "expected"), CASES)
def test_a_reply_rendered_by_the_family_s_template_reads_back(
    family: str, message: dict[str, Any], expected: Reply
) -> None:
    tokenizer = family_tokenizer(family)
    fmt = detect_format(tokenizer.chat_template)
    tools = {"tools": [WEATHER]} if fmt.tool_calls else {}
    chat = read_chat(
        [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", **message}],
        "messages",
        tools_from=tools,
    )
    prompt = render(tokenizer, chat, 1, generation_prompt=True)
    full = render(tokenizer, chat, 2, generation_prompt=False)
    assert full.startswith(prompt)
    # what the model writes: the assistant's part up to and including the first token it stops on
    ids = tokenizer(full[len(prompt) :], add_special_tokens=False)["input_ids"]
    stops = {tokenizer.convert_tokens_to_ids(t) for t in FAMILIES[family].generation_eos}
    ids = ids[: next(i for i, t in enumerate(ids) if t in stops) + 1]
    decode = marker_decoder(tokenizer, fmt.markers)
    text = decode(ids)

    assert fmt.parse(text, prompt) == expected
    by_token = [decode(ids[: i + 1])[len(decode(ids[:i])) :] for i in range(len(ids))]
    assert "".join(by_token) == text
    assert streamed(fmt.name, by_token, prompt) == expected
    assert streamed(fmt.name, list(text), prompt) == expected


def test_markers_are_held_back_until_they_show_what_they_are() -> None:
    reader = FORMATS["hermes"].reader()
    assert reader.feed("It is") == [Delta(content="It is")]
    assert reader.feed(" sunny.\n<tool") == [
        Delta(content=" sunny.")
    ]  # the newline before a call is not content
    assert reader.feed('_call>\n{"name": "get_weather", ') == []  # a call is handed out whole
    assert reader.feed('"arguments": {"city": "Paris"}}\n</tool_call>') == [
        Delta(tool_call=expected_call("Paris"))
    ]
    assert reader.close() == []

    reader = FORMATS["hermes"].reader()
    assert reader.feed("<thi") == []  # may open the reasoning
    assert reader.feed("nk>\nHm") == [Delta(reasoning="Hm")]
    assert reader.feed("m\n\n") == [Delta(reasoning="m")]  # newlines may close it
    assert reader.feed("</think>\n\nHi") == [Delta(content="Hi")]

    reader = FORMATS["harmony"].reader()
    assert reader.feed("<|channel|>analysis<|message|>Hm<|") == [Delta(reasoning="Hm")]
    assert reader.feed("end|><|start|>assistant<|channel|>final<|message|>Hi") == [Delta(content="Hi")]

    reader = FORMATS["llama3_json"].reader()
    assert reader.feed("  ") == []  # may come before a call
    assert reader.feed('{"answer": 1}') == []  # a call or not: known at the end
    assert reader.close() == [Delta(content='  {"answer": 1}')]


MALFORMED = [
    # bad JSON, no name, arguments that are no object: left as written
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "argu'),  # cut by max_tokens
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": '),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": "Paris"}'),
    ("harmony", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{city}<|call|>"),
    ("harmony", "<|channel|>commentary to=browser.search<|message|>{}<|call|>"),  # not a function
    ("harmony", "<|channel|>final"),  # a header cut before its message
    ("harmony", "<|channel|>commentary to=functions.<|message|>{}<|call|>"),  # a function without a name
]


@pytest.mark.parametrize(("name", "text"), MALFORMED)
def test_markup_that_does_not_parse_is_left_in_the_content(name: str, text: str) -> None:
    reply = FORMATS[name].parse(text)
    assert reply.tool_calls == [] and reply.reasoning_content is None
    assert reply.content.replace("<|channel|>", "").strip() in text
    assert reply.content.strip() and reply.content.strip() in text
    assert streamed(name, list(text), "") == reply


def test_calls_and_text_around_them() -> None:
    two = (
        'Both.\n<tool_call>\n{"name": "a", "arguments": "{\\"x\\": 1}"}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "parameters": {}}\n</tool_call>\nDone.'
    )
    # arguments given as a JSON string or under "parameters" are read too; text after the calls is content
    assert FORMATS["hermes"].parse(two) == Reply(
        "Both.\nDone.", None, [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")]
    )
    # whitespace between and after calls is the template's; a call without arguments has none
    spaced = '<tool_call>{"name": "a"}</tool_call>\n\n<tool_call>{"name": "b"}</tool_call>\n'
    assert FORMATS["hermes"].parse(spaced) == Reply("", None, [ToolCall("a", "{}"), ToolCall("b", "{}")])
    assert FORMATS["llama3_json"].parse(
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    ) == Reply("", None, [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")])
    # gpt-oss's own order: the recipient after the channel, a constraint; a preamble to nobody is content
    harmony = (
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    )
    assert FORMATS["harmony"].parse(harmony) == Reply("Checking.", None, [expected_call("Paris")])


def test_think_and_plain() -> None:
    # a generation prompt that opens the reasoning (DeepSeek-R1's) starts the output inside it
    assert FORMATS["think"].parse("Hm.\n</think>\n\nHi.", prompt="<｜Assistant｜><think>\n") == Reply(
        "Hi.", "Hm.", []
    )
    assert FORMATS["think"].parse("<think>Hm.</think>Hi.") == Reply("Hi.", "Hm.", [])
    assert FORMATS["think"].parse("Hi <think>") == Reply("Hi <think>", None, [])  # not leading: content
    text = '<think>x</think><tool_call>{"name": "a"}</tool_call>'
    assert FORMATS["plain"].parse(text) == Reply(text, None, [])


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'),
        ("llama3_json", '{"name": "a", "parameters": {}}'),
        ("harmony", "<|channel|>commentary to=functions.a <|constrain|>json<|message|>{}<|call|>"),
    ],
)
def test_where_no_tool_may_be_called_a_call_is_content_as_written(name: str, text: str) -> None:
    assert FORMATS[name].parse(text).tool_calls  # read as a call where calls may be made
    reply = FORMATS[name].parse(text, tool_calls=False)
    assert reply.tool_calls == [] and reply.content.replace("<|channel|>", "") in text
