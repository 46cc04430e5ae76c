"""Unit tests for the incremental JSONL training-file validator (service/files/validation.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.files.validation import (
    FileStats,
    FileValidationError,
    JsonlValidator,
    method_formats,
    validate_chunks,
)
from trainers.formats import FileFormat

# -- helpers ------------------------------------------------------------------------------------------------


def jl(*examples: Any) -> bytes:
    """A JSONL file (with trailing newline) from examples; str items are taken as raw lines."""
    lines = [e if isinstance(e, str) else json.dumps(e, ensure_ascii=False) for e in examples]
    return ("\n".join(lines) + "\n").encode()


def chunks(data: bytes, size: int | None) -> list[bytes]:
    if size is None:
        return [data]
    return [data[i : i + size] for i in range(0, len(data), size)]


def validate(data: bytes, chunk_size: int | None = None, **kwargs: Any) -> FileStats:
    return validate_chunks(chunks(data, chunk_size), **kwargs)


def error(data: bytes, chunk_size: int | None = None, **kwargs: Any) -> FileValidationError:
    with pytest.raises(FileValidationError) as info:
        validate(data, chunk_size, **kwargs)
    return info.value


def outcome(data: bytes, chunk_size: int | None, **kwargs: Any) -> object:
    try:
        return validate(data, chunk_size, **kwargs)
    except FileValidationError as exc:
        return (str(exc), exc.line, exc.field)


def user(text: str = "Hi") -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str = "Hello!", **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": text, **extra}


CHAT = {"messages": [{"role": "system", "content": "Be nice."}, user(), assistant()]}
PC = {"prompt": "2+2=", "completion": "4"}
TEXT = {"text": "Once upon a time."}
PREF_OPENAI = {
    "input": {"messages": [user("Pick one")]},
    "preferred_output": [assistant("A")],
    "non_preferred_output": [assistant("B")],
}
PREF_PAIRS = {"prompt": "Pick one", "chosen": "A", "rejected": "B"}
RL_MESSAGES = {"messages": [user("What is 2+2?")], "answer": "4"}
RL_PROMPT = {"prompt": "What is 2+2?", "answer": "4"}
FEEDBACK = {"prompt": "2+2=", "completion": "4", "label": True}
FEEDBACK_CHAT = {"prompt": [user("2+2=")], "completion": [assistant("5")], "label": False}
FEEDBACK_MESSAGES = {"messages": [user("2+2="), assistant("4")], "label": True}


def assert_error(exc: FileValidationError, line: int | None, field: str | None, contains: str = "") -> None:
    assert exc.line == line, str(exc)
    assert exc.field == field, str(exc)
    if line is not None:
        prefix = f"line {line}: " + (f"field {field!r}: " if field is not None else "")
        assert str(exc).startswith(prefix), str(exc)
    assert contains in str(exc)


# -- format detection ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("example", "fmt"),
    [
        (CHAT, FileFormat.CHAT),
        (PC, FileFormat.PROMPT_COMPLETION),
        (TEXT, FileFormat.TEXT),
        (PREF_OPENAI, FileFormat.PREFERENCE),
        (PREF_PAIRS, FileFormat.PREFERENCE),
        (
            {"prompt": [user("Pick")], "chosen": [assistant("A")], "rejected": [assistant("B")]},
            FileFormat.PREFERENCE,
        ),
        (RL_MESSAGES, FileFormat.PROMPT_ONLY),
        (RL_PROMPT, FileFormat.PROMPT_ONLY),
        ({"messages": [user(), assistant(), user("And now?")]}, FileFormat.PROMPT_ONLY),
        (FEEDBACK, FileFormat.UNPAIRED_PREFERENCE),
        (FEEDBACK_CHAT, FileFormat.UNPAIRED_PREFERENCE),
        (FEEDBACK_MESSAGES, FileFormat.UNPAIRED_PREFERENCE),
    ],
)
def test_every_format_is_detected(example: dict[str, Any], fmt: FileFormat) -> None:
    data = jl(example, example, example)
    stats = validate(data)
    assert stats == FileStats(line_count=3, format=fmt, bytes=len(data))


def test_method_formats() -> None:
    assert method_formats("supervised") == {FileFormat.CHAT, FileFormat.PROMPT_COMPLETION, FileFormat.TEXT}
    assert method_formats("dpo") == method_formats("reward_model") == {FileFormat.PREFERENCE}
    for method in ("grpo", "ppo", "reinforcement"):
        assert method_formats(method) == {FileFormat.PROMPT_ONLY}
    for method in ("orpo", "cpo", "simpo"):
        assert method_formats(method) == {FileFormat.PREFERENCE}
    assert method_formats("kto") == {FileFormat.UNPAIRED_PREFERENCE, FileFormat.PREFERENCE}
    assert isinstance(FileFormat.CHAT, str)
    assert str(FileFormat.CHAT) == FileFormat.CHAT.value == "chat"
    assert FileFormat("prompt_only") is FileFormat.PROMPT_ONLY


def test_unrecognised_example() -> None:
    exc = error(jl(CHAT, {"question": "?", "reply": "!"}))
    assert_error(exc, 2, None, "cannot detect the example's format")
    assert "'question', 'reply'" in str(exc)


def test_mixed_formats_are_rejected() -> None:
    exc = error(jl(CHAT, CHAT, TEXT))
    assert str(exc) == "line 3: format 'text' differs from the file's format 'chat' (detected at line 1)"
    assert_error(exc, 3, None)


def test_mixed_formats_report_the_line_the_format_was_detected_at() -> None:
    exc = error(jl("", PC, PREF_PAIRS))
    assert str(exc) == (
        "line 3: format 'preference' differs from the file's format 'prompt_completion' (detected at line 2)"
    )


def test_a_file_uses_one_preference_shape() -> None:
    # the trainers read the shape from line 1, so a mixed file is rejected here, not at run time
    assert validate(jl(PREF_OPENAI, PREF_OPENAI)).format is FileFormat.PREFERENCE
    assert validate(jl(PREF_PAIRS, PREF_PAIRS)).format is FileFormat.PREFERENCE
    err = error(jl(PREF_OPENAI, PREF_PAIRS))
    assert err.line == 2 and "one shape per file" in err.message


def test_rl_prompts_use_one_shape_and_carry_extra_fields() -> None:
    data = jl(RL_PROMPT, {"prompt": "p", "completion": "reference", "tests": [1, 2]})
    assert validate(data) == FileStats(line_count=2, format=FileFormat.PROMPT_ONLY, bytes=len(data))
    err = error(jl(RL_MESSAGES, RL_PROMPT))
    assert err.line == 2 and "one shape per file" in err.message


def test_extra_top_level_fields_are_ignored() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = {**CHAT, "tools": tools, "parallel_tool_calls": False, "metadata": {"x": 1}}
    assert validate(jl(chat, chat)).format is FileFormat.CHAT
    assert validate(jl({**TEXT, "source": "wiki"})).format is FileFormat.TEXT


# -- JSON / structure ---------------------------------------------------------------------------------------


def test_invalid_json() -> None:
    exc = error(jl(TEXT, '{"text": "a",}'))
    assert_error(exc, 2, None, "invalid JSON: ")
    assert str(exc).startswith("line 2: invalid JSON: Expecting property name")


def test_nan_is_not_json() -> None:
    assert_error(error(jl('{"text": "a", "score": NaN}')), 1, None, "invalid JSON: NaN")


def test_deep_nesting_is_an_error_not_a_crash() -> None:
    assert_error(error(jl(TEXT, "[" * 100_000)), 2, None, "invalid JSON")


@pytest.mark.parametrize(("raw", "kind"), [("[1, 2]", "array"), ('"text"', "string"), ("3", "number")])
def test_each_line_must_be_an_object(raw: str, kind: str) -> None:
    exc = error(jl(TEXT, raw))
    assert str(exc) == f"line 2: expected a JSON object, got {kind}"
    assert_error(exc, 2, None)


# -- messages -----------------------------------------------------------------------------------------------


def chat_error(*messages: Any) -> FileValidationError:
    """Error for a chat file whose second example has the given messages."""
    return error(jl(CHAT, {"messages": list(messages)}))


def test_unknown_role() -> None:
    exc = chat_error(user(), {"role": "bot", "content": "x"})
    assert str(exc) == (
        "line 2: field 'messages[1].role': unknown role 'bot' "
        "(expected system, developer, user, assistant, tool, function)"
    )
    assert_error(exc, 2, "messages[1].role")


def test_missing_role() -> None:
    assert_error(chat_error(user(), {"content": "x"}), 2, "messages[1].role", "missing")


def test_role_must_be_a_string() -> None:
    assert_error(
        chat_error({"role": 1, "content": "x"}), 2, "messages[0].role", "expected a string, got number"
    )


def test_messages_must_be_a_non_empty_array() -> None:
    assert_error(error(jl(CHAT, {"messages": []})), 2, "messages", "non-empty")
    assert_error(error(jl(CHAT, {"messages": "hi"})), 2, "messages", "expected an array, got string")


def test_message_must_be_an_object() -> None:
    assert_error(chat_error(user(), "hello", assistant()), 2, "messages[1]", "expected an object, got string")


def test_content_missing() -> None:
    assert_error(chat_error({"role": "user"}, assistant()), 2, "messages[0].content", "missing")
    exc = chat_error(user(), {"role": "assistant"})
    assert_error(exc, 2, "messages[1].content", "content or tool_calls")


@pytest.mark.parametrize("content", ["", "   \n"])
def test_content_must_be_non_empty(content: str) -> None:
    assert_error(chat_error(user(), assistant(content)), 2, "messages[1].content", "non-empty string")


@pytest.mark.parametrize(("content", "kind"), [(None, "null"), (3, "number"), ({"text": "x"}, "object")])
def test_content_type(content: object, kind: str) -> None:
    exc = chat_error({"role": "user", "content": content}, assistant())
    assert_error(exc, 2, "messages[0].content", f"got {kind}")


def test_content_as_text_parts() -> None:
    parts = {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}
    assert validate(jl({"messages": [parts, assistant()]})).format is FileFormat.CHAT
    bad_type = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "input_audio", "input_audio": {}}],
    }
    assert_error(chat_error(bad_type, assistant()), 2, "messages[0].content[1].type", "'input_audio'")
    # an image part is read (docs/vision.md), and checked as one: a missing URL is named
    no_url = {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}
    assert_error(chat_error(no_url, assistant()), 2, "messages[0].content[0].image_url.url", "missing")
    empty_text = {"role": "user", "content": [{"type": "text", "text": ""}]}
    assert_error(chat_error(empty_text, assistant()), 2, "messages[0].content[0].text", "non-empty")
    no_parts = {"role": "user", "content": []}
    assert_error(chat_error(no_parts, assistant()), 2, "messages[0].content", "non-empty")


TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}


def test_assistant_tool_calls_may_replace_content() -> None:
    example = {
        "messages": [
            user("1+2?"),
            {"role": "assistant", "tool_calls": [TOOL_CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
            {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
            assistant("It is 3."),
        ],
        "tools": [{"type": "function", "function": {"name": "add"}}],
    }
    assert validate(jl(example)).format is FileFormat.CHAT


def test_tool_calls_only_on_assistant_messages() -> None:
    exc = chat_error({"role": "user", "content": "x", "tool_calls": [TOOL_CALL]}, assistant())
    assert_error(exc, 2, "messages[0].tool_calls", "only assistant")


def test_tool_calls_shape() -> None:
    assert_error(
        chat_error(user(), {"role": "assistant", "tool_calls": []}), 2, "messages[1].tool_calls", "non-empty"
    )
    nameless = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}
    assert_error(chat_error(user(), nameless), 2, "messages[1].tool_calls[0].function.name", "missing")


def test_tool_message_needs_content() -> None:
    exc = chat_error(user(), assistant(), {"role": "tool", "tool_call_id": "c1"}, assistant())
    assert_error(exc, 2, "messages[2].content", "missing")


@pytest.mark.parametrize("weight", [0.5, 2, -1, True, "1", None])
def test_weight_must_be_0_or_1(weight: object) -> None:
    exc = chat_error(user(), assistant(weight=weight), user(), assistant())
    assert_error(exc, 2, "messages[1].weight", "must be 0 or 1")


def test_weights_0_and_1_are_accepted() -> None:
    example = {
        "messages": [user(), assistant(weight=0), user(), assistant(weight=1), user(), assistant(weight=1.0)]
    }
    assert validate(jl(example)).format is FileFormat.CHAT


def test_all_assistant_weights_zero() -> None:
    exc = chat_error(user(), assistant(weight=0), user(), assistant(weight=0))
    assert str(exc) == "line 2: field 'messages': no assistant message with weight 1"
    assert_error(exc, 2, "messages")


def test_chat_example_needs_an_assistant_message() -> None:
    exc = error(jl(CHAT, {"messages": [user()]}))
    assert_error(exc, 2, "messages", "no assistant message")


def test_first_chat_example_with_only_zero_weights() -> None:
    assert_error(error(jl({"messages": [user(), assistant(weight=0)]})), 1, "messages", "weight 1")


# -- prompt/completion, text --------------------------------------------------------------------------------


def test_prompt_completion_fields() -> None:
    assert_error(error(jl(PC, {"prompt": "p"})), 2, "completion", "missing")
    assert_error(error(jl(PC, {"prompt": "p", "completion": ""})), 2, "completion", "non-empty")
    assert_error(
        error(jl(PC, {"prompt": 1, "completion": "c"})),
        2,
        "prompt",
        "expected a non-empty string or a list of messages, got number",
    )
    # a conversational prompt/completion row (TRL's): message lists, checked as chat rows
    assert_error(error(jl({"prompt": "p", "completion": ["c"]})), 1, "completion[0]", "expected an object")


def test_prompt_completion_allows_empty_prompt() -> None:
    assert validate(jl({"prompt": "", "completion": "c"})).format is FileFormat.PROMPT_COMPLETION


def test_text_fields() -> None:
    assert_error(error(jl(TEXT, {"text": ""})), 2, "text", "non-empty")
    assert_error(error(jl(TEXT, {"text": None})), 2, "text", "expected a string, got null")


# -- preference ---------------------------------------------------------------------------------------------


def test_preference_openai_required_fields() -> None:
    missing = {k: v for k, v in PREF_OPENAI.items() if k != "non_preferred_output"}
    assert_error(error(jl(PREF_OPENAI, missing)), 2, "non_preferred_output", "missing")
    no_input = {k: v for k, v in PREF_OPENAI.items() if k != "input"}
    assert_error(error(jl(PREF_OPENAI, no_input)), 2, "input", "missing")
    assert_error(error(jl(PREF_OPENAI, {**PREF_OPENAI, "input": "hi"})), 2, "input", "expected an object")
    assert_error(error(jl(PREF_OPENAI, {**PREF_OPENAI, "input": {}})), 2, "input.messages", "missing")
    assert_error(
        error(jl(PREF_OPENAI, {**PREF_OPENAI, "input": {"messages": []}})), 2, "input.messages", "non-empty"
    )
    bad_role = {**PREF_OPENAI, "input": {"messages": [{"role": "human", "content": "x"}]}}
    assert_error(error(jl(PREF_OPENAI, bad_role)), 2, "input.messages[0].role", "unknown role 'human'")


def test_preference_openai_outputs_are_assistant_messages() -> None:
    exc = error(jl(PREF_OPENAI, {**PREF_OPENAI, "preferred_output": [user("A")]}))
    assert_error(exc, 2, "preferred_output[0].role", "expected 'assistant', got 'user'")
    exc = error(jl(PREF_OPENAI, {**PREF_OPENAI, "non_preferred_output": []}))
    assert_error(exc, 2, "non_preferred_output", "non-empty")
    exc = error(jl(PREF_OPENAI, {**PREF_OPENAI, "preferred_output": "A"}))
    assert_error(exc, 2, "preferred_output", "expected an array")


def test_preference_pairs_fields() -> None:
    assert_error(error(jl(PREF_PAIRS, {"prompt": "p", "chosen": "a"})), 2, "rejected", "missing")
    assert_error(error(jl(PREF_PAIRS, {"chosen": "a", "rejected": "b"})), 2, "prompt", "missing")
    exc = error(jl(PREF_PAIRS, {**PREF_PAIRS, "chosen": 1}))
    assert_error(exc, 2, "chosen", "expected a non-empty string or a list of messages, got number")
    assert_error(error(jl(PREF_PAIRS, {**PREF_PAIRS, "rejected": ""})), 2, "rejected", "non-empty")
    bad = {**PREF_PAIRS, "rejected": [{"role": "assistant", "content": ""}]}
    assert_error(error(jl(PREF_PAIRS, bad)), 2, "rejected[0].content", "non-empty")


def test_preference_chosen_may_equal_rejected() -> None:
    assert validate(jl({"prompt": "p", "chosen": "same", "rejected": "same"})).line_count == 1


# -- RL prompts ---------------------------------------------------------------------------------------------


def test_prompt_only_messages_must_not_end_with_assistant() -> None:
    exc = error(jl(RL_MESSAGES, {"messages": [user(), assistant()]}))
    assert_error(exc, 2, "messages[1].role", "must not be from the assistant")


def test_prompt_only_prompt_must_be_a_non_empty_string() -> None:
    assert_error(error(jl(RL_PROMPT, {"prompt": ""})), 2, "prompt", "non-empty")
    assert_error(error(jl(RL_PROMPT, {"prompt": 5})), 2, "prompt", "expected a string")


def test_prompt_only_messages_are_validated() -> None:
    exc = error(jl(RL_MESSAGES, {"messages": [{"role": "user", "content": ""}]}))
    assert_error(exc, 2, "messages[0].content", "non-empty")


# -- unpaired feedback (KTO) -------------------------------------------------------------------------------


def test_unpaired_feedback_labels_are_booleans() -> None:
    assert validate(jl(FEEDBACK, {**FEEDBACK, "label": False})).line_count == 2
    exc = error(jl(FEEDBACK, {**FEEDBACK, "label": "yes"}))
    assert_error(exc, 2, "label", "expected true or false, got string")
    exc = error(jl(FEEDBACK_MESSAGES, {"messages": FEEDBACK_MESSAGES["messages"]}))
    assert_error(exc, 2, "label", "missing")
    assert_error(error(jl(FEEDBACK, {**FEEDBACK, "label": 1})), 2, "label", "got number")
    # a non-boolean label on the first line is an extra field of another format, not unpaired feedback
    assert validate(jl({**PC, "label": "math"})).format is FileFormat.PROMPT_COMPLETION
    assert validate(jl({**RL_MESSAGES, "label": 3})).format is FileFormat.PROMPT_ONLY


def test_unpaired_feedback_fields() -> None:
    assert_error(error(jl(FEEDBACK, {"prompt": "p", "label": True})), 2, "completion", "missing")
    assert_error(error(jl(FEEDBACK, {"completion": "c", "label": True})), 2, "prompt", "missing")
    assert_error(error(jl(FEEDBACK, {**FEEDBACK, "completion": ""})), 2, "completion", "non-empty")
    exc = error(jl(FEEDBACK_CHAT, {**FEEDBACK_CHAT, "completion": [user("x")]}))
    assert_error(exc, 2, "completion[0].role", "expected 'assistant', got 'user'")
    exc = error(jl(FEEDBACK_MESSAGES, {"messages": [user(), user()], "label": True}))
    assert_error(exc, 2, "messages[1].role", "the last message must be the assistant's judged completion")
    exc = error(jl(FEEDBACK_MESSAGES, {"messages": [assistant()], "label": True}))
    assert_error(exc, 2, "messages", "needs the prompt's messages")


def test_a_file_uses_one_unpaired_feedback_shape() -> None:
    assert validate(jl(FEEDBACK, FEEDBACK_CHAT)).format is FileFormat.UNPAIRED_PREFERENCE
    err = error(jl(FEEDBACK, FEEDBACK_MESSAGES))
    assert err.line == 2 and "one shape per file" in err.message
    exc = error(jl(FEEDBACK, PC))  # an SFT row in a feedback file reads as a row missing its label
    assert_error(exc, 2, "label", "missing")


# -- file-level rules ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"", b"\n", b"  \n\t\n\r\n", b"   "])
def test_empty_file(data: bytes) -> None:
    exc = error(data)
    assert str(exc) == "file is empty"
    assert_error(exc, None, None)


def test_too_few_examples() -> None:
    exc = error(jl(TEXT, "", TEXT), min_examples=10)
    assert str(exc) == "file has 2 examples; at least 10 are required"
    assert_error(exc, None, None)
    assert str(error(jl(TEXT), min_examples=2)) == "file has 1 example; at least 2 are required"
    assert validate(jl(TEXT, TEXT), min_examples=2).line_count == 2


def test_blank_lines_are_skipped_but_counted_as_lines() -> None:
    data = b"\n" + jl(TEXT) + b"   \n\t\n" + jl(TEXT) + b"\n\n"
    assert validate(data) == FileStats(line_count=2, format=FileFormat.TEXT, bytes=len(data))
    bad = b"\n" + jl(TEXT) + b"  \n" + b'{"text": ""}\n'
    assert_error(error(bad), 4, "text")


def test_crlf_line_endings() -> None:
    data = jl(CHAT, CHAT).replace(b"\n", b"\r\n") + b"\r\n"
    assert validate(data) == FileStats(line_count=2, format=FileFormat.CHAT, bytes=len(data))
    bad = jl(TEXT, "", "{oops").replace(b"\n", b"\r\n")
    assert_error(error(bad), 3, None, "invalid JSON")


def test_no_trailing_newline() -> None:
    data = jl(TEXT, TEXT).rstrip(b"\n")
    assert validate(data) == FileStats(line_count=2, format=FileFormat.TEXT, bytes=len(data))
    validator = JsonlValidator()
    validator.feed(jl(TEXT) + b'{"text": ""}')  # the incomplete last line is only checked by finish()
    with pytest.raises(FileValidationError) as info:
        validator.finish()
    assert_error(info.value, 2, "text", "non-empty")


def test_byte_order_mark_is_tolerated() -> None:
    assert validate(b"\xef\xbb\xbf" + jl(TEXT, TEXT)).line_count == 2


# -- encoding and line length -------------------------------------------------------------------------------


def test_invalid_utf8_reports_its_line() -> None:
    data = jl(TEXT, TEXT) + b'{"text": "caf\xe9"}\n' + jl(TEXT)
    for size in (1, 7, None):
        exc = error(data, size)
        assert_error(exc, 3, None, "invalid UTF-8")


def test_multibyte_character_split_across_chunks() -> None:
    data = jl({"text": "héllo wörld 😀 日本語"}, {"text": "ü"})
    for size in range(1, 8):
        assert validate(data, size) == FileStats(line_count=2, format=FileFormat.TEXT, bytes=len(data))
    emoji = "😀".encode()
    # A split right inside the 4-byte emoji, fed as separate chunks.
    validator = JsonlValidator()
    for part in (b'{"text": "', emoji[:1], emoji[1:3], emoji[3:], b'"}\n'):
        validator.feed(part)
    assert validator.finish().line_count == 1


def test_over_long_line() -> None:
    limit = 100
    ok = {"text": "x" * (limit - len('{"text": ""}'))}
    assert len(json.dumps(ok)) == limit
    long = {"text": "x" * limit}
    data = jl(ok, long, ok)
    for size in (1, 7, None):
        exc = error(data, size, max_line_bytes=limit)
        assert str(exc) == f"line 2: line is longer than {limit} bytes"
        assert_error(exc, 2, None)
    # Exactly at the limit is fine, with LF or CRLF endings, and without a final newline.
    assert validate(jl(ok, ok), max_line_bytes=limit).line_count == 2
    for size in (1, 7, None):
        assert validate(jl(ok, ok).replace(b"\n", b"\r\n"), size, max_line_bytes=limit).line_count == 2
    assert validate(jl(ok).rstrip(b"\n"), max_line_bytes=limit).line_count == 1


def test_over_long_line_is_rejected_before_it_ends() -> None:
    """At most one partial line (bounded by the limit) is held: a runaway line fails early."""
    limit = 1000
    validator = JsonlValidator(max_line_bytes=limit)
    validator.feed(jl(TEXT))
    fed = 0
    with pytest.raises(FileValidationError) as info:
        for _ in range(10 * limit):
            validator.feed(b"x")
            fed += 1
    assert fed == limit  # the byte after the limit fails: nothing beyond one line's worth is held
    assert_error(info.value, 2, None, "longer than")


def test_over_long_last_line_without_newline() -> None:
    exc = error(jl(TEXT) + b"x" * 50, max_line_bytes=40)
    assert_error(exc, 2, None, "longer than 40 bytes")


def test_default_limit_is_4_mib() -> None:
    big = {"text": "y" * (4 * 1024 * 1024 - 100)}
    assert validate(jl(big), 64 * 1024).line_count == 1
    assert_error(error(jl(TEXT, {"text": "y" * (4 * 1024 * 1024)})), 2, None, "longer than 4194304 bytes")


# -- incremental feeding ------------------------------------------------------------------------------------

SAMPLES: list[bytes] = [
    jl(CHAT, CHAT, {"messages": [user("Ünïcødé 😀"), assistant("日本語", weight=1)]}),
    jl(PC, "", PC).replace(b"\n", b"\r\n"),
    jl(TEXT, TEXT).rstrip(b"\n"),
    jl(PREF_OPENAI, PREF_PAIRS),
    jl(RL_MESSAGES, RL_PROMPT),
    jl(CHAT, TEXT),
    jl(CHAT, "{bad json"),
    jl(TEXT, {"text": "é"}) + b"\xff\xfe\n",
    jl(CHAT, {"messages": [user(), {"role": "bot", "content": "x"}]}),
    b"\n\n",
    jl(TEXT, {"text": 1}).rstrip(b"\n"),
]


@pytest.mark.parametrize("data", SAMPLES)
def test_chunk_size_does_not_change_the_result(data: bytes) -> None:
    whole = outcome(data, None)
    assert outcome(data, 1) == whole
    assert outcome(data, 7) == whole
    for size in range(2, 20):
        assert outcome(data, size) == whole


def test_empty_chunks_are_harmless() -> None:
    validator = JsonlValidator()
    for part in (b"", jl(TEXT), b"", b""):
        validator.feed(part)
    assert validator.finish().line_count == 1


# -- validator lifecycle ------------------------------------------------------------------------------------


def test_first_error_is_sticky() -> None:
    validator = JsonlValidator()
    with pytest.raises(FileValidationError) as first:
        validator.feed(jl(TEXT, "nope", TEXT))
    with pytest.raises(FileValidationError) as again:
        validator.feed(jl(TEXT))
    assert again.value is first.value
    with pytest.raises(FileValidationError) as at_finish:
        validator.finish()
    assert at_finish.value is first.value
    assert first.value.line == 2


def test_finish_is_idempotent_and_ends_feeding() -> None:
    validator = JsonlValidator()
    validator.feed(jl(TEXT))
    assert validator.format is FileFormat.TEXT
    stats = validator.finish()
    assert validator.finish() == stats
    with pytest.raises(RuntimeError):
        validator.feed(jl(TEXT))


def test_invalid_settings() -> None:
    with pytest.raises(ValueError, match="min_examples"):
        JsonlValidator(min_examples=0)
    with pytest.raises(ValueError, match="max_line_bytes"):
        JsonlValidator(max_line_bytes=0)


def test_error_attributes() -> None:
    exc = FileValidationError("line 1: field 'x': bad", line=1, field="x")
    assert (exc.message, exc.line, exc.field) == ("line 1: field 'x': bad", 1, "x")
    assert str(exc) == "line 1: field 'x': bad"


# -- what a client reads: exact line, field and message ------------------------------------------------------

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL_REPLY = {"role": "tool", "content": "r", "tool_call_id": "c1"}
UNDETECTABLE = (
    "line 1: cannot detect the example's format: expected 'messages', 'prompt' (and 'completion'), 'text', "
    "'input'/'preferred_output'/'non_preferred_output', 'prompt'/'chosen'/'rejected' or a boolean 'label' "
    "(with 'prompt'/'completion' or 'messages') (found keys: "
)
SHAPES = "differs from the file's shape"
EXACT_ERRORS: dict[str, tuple[list[Any], int, str | None, str]] = {
    "keys beyond eight are elided": (
        [{f"k{i}": i for i in range(10)}],
        1,
        None,
        UNDETECTABLE + "'k0', 'k1', 'k2', 'k3', 'k4', 'k5', 'k6', 'k7', ...)",
    ),
    "no keys": ([{}], 1, None, UNDETECTABLE + "none)"),
    "a 40-character key is shown whole": ([{"x" * 38: 1}], 1, None, UNDETECTABLE + f"'{'x' * 38}')"),
    "a 41-character key is cut to 40": ([{"x" * 39: 1}], 1, None, UNDETECTABLE + f"'{'x' * 36}...)"),
    "'rejected' alone makes a preference pair": (
        [{"prompt": "p", "rejected": "r"}],
        1,
        "chosen",
        "line 1: field 'chosen': missing",
    ),
    "'non_preferred_output' alone makes a preference pair": (
        [{"input": {"messages": [user()]}, "non_preferred_output": [assistant()]}],
        1,
        "preferred_output",
        "line 1: field 'preferred_output': missing",
    ),
    "a name must be a string": (
        [{"messages": [{**user(), "name": True}, assistant()]}],
        1,
        "messages[0].name",
        "line 1: field 'messages[0].name': expected a string, got boolean",
    ),
    "a tool_call_id must be a string": (
        [
            {
                "messages": [
                    user(),
                    assistant("", tool_calls=[CALL]),
                    {**TOOL_REPLY, "tool_call_id": 5},
                    assistant(),
                ]
            }
        ],
        1,
        "messages[2].tool_call_id",
        "line 1: field 'messages[2].tool_call_id': expected a string, got number",
    ),
    "a weight is 0 or 1": (
        [{"messages": [user(), assistant(weight=2)]}],
        1,
        "messages[1].weight",
        "line 1: field 'messages[1].weight': must be 0 or 1, got 2",
    ),
    "an assistant needs content or tool_calls": (
        [{"messages": [user(), {"role": "assistant"}]}],
        1,
        "messages[1].content",
        "line 1: field 'messages[1].content': missing (an assistant message needs content or tool_calls)",
    ),
    "a user needs content": (
        [{"messages": [{"role": "user"}, assistant()]}],
        1,
        "messages[0].content",
        "line 1: field 'messages[0].content': missing",
    ),
    "an empty list of content parts": (
        [{"messages": [{"role": "user", "content": []}, assistant()]}],
        1,
        "messages[0].content",
        "line 1: field 'messages[0].content': must be a non-empty string or a non-empty list of text parts",
    ),
    "a content part must be an object": (
        [{"messages": [{"role": "user", "content": ["x"]}, assistant()]}],
        1,
        "messages[0].content[0]",
        "line 1: field 'messages[0].content[0]': expected an object, got string",
    ),
    "a content part needs a type": (
        [{"messages": [{"role": "user", "content": [{"text": "x"}]}, assistant()]}],
        1,
        "messages[0].content[0].type",
        "line 1: field 'messages[0].content[0].type': missing",
    ),
    "only function tool calls": (
        [{"messages": [user(), assistant("", tool_calls=[{**CALL, "type": "code"}]), assistant()]}],
        1,
        "messages[1].tool_calls[0].type",
        "line 1: field 'messages[1].tool_calls[0].type': "
        "unsupported tool call type 'code' (expected 'function')",
    ),
    "a tool call needs its function": (
        [{"messages": [user(), assistant("", tool_calls=[{"id": "c1", "type": "function"}]), assistant()]}],
        1,
        "messages[1].tool_calls[0].function",
        "line 1: field 'messages[1].tool_calls[0].function': missing",
    ),
    "tool call arguments are a string or an object": (
        [
            {
                "messages": [
                    user(),
                    assistant("", tool_calls=[{**CALL, "function": {"name": "f", "arguments": 3}}]),
                    assistant(),
                ]
            }
        ],
        1,
        "messages[1].tool_calls[0].function.arguments",
        "line 1: field 'messages[1].tool_calls[0].function.arguments': "
        "expected a string or an object, got number",
    ),
    "empty messages are a prompt without messages": (
        [{"messages": []}],
        1,
        "messages",
        "line 1: field 'messages': must be a non-empty array",
    ),
    "a prompt may not end with the assistant": (
        [{"messages": [user()]}, {"messages": [user(), assistant()]}],
        2,
        "messages[1].role",
        "line 2: field 'messages[1].role': the last message of a prompt must not be from the assistant",
    ),
    "prompt shapes: messages, then prompt": (
        [{"messages": [user()]}, {"prompt": "p"}],
        2,
        None,
        f"line 2: shape 'prompt' {SHAPES} 'messages' (line 1); use one shape per file",
    ),
    "prompt shapes: prompt, then messages": (
        [{"prompt": "p"}, {"messages": [user()]}],
        2,
        None,
        f"line 2: shape 'messages' {SHAPES} 'prompt' (line 1); use one shape per file",
    ),
    "preference shapes: OpenAI's, then pairs": (
        [PREF_OPENAI, PREF_PAIRS],
        2,
        None,
        f"line 2: shape 'prompt/chosen/rejected' {SHAPES} 'input/preferred_output/non_preferred_output' "
        "(line 1); use one shape per file",
    ),
    "preference shapes: pairs, then OpenAI's": (
        [PREF_PAIRS, PREF_OPENAI],
        2,
        None,
        f"line 2: shape 'input/preferred_output/non_preferred_output' {SHAPES} 'prompt/chosen/rejected' "
        "(line 1); use one shape per file",
    ),
    "feedback shapes: messages, then prompt/completion": (
        [FEEDBACK_MESSAGES, FEEDBACK],
        2,
        None,
        f"line 2: shape 'prompt/completion/label' {SHAPES} 'messages/label' (line 1); use one shape per file",
    ),
    "feedback shapes: prompt/completion, then messages": (
        [FEEDBACK, FEEDBACK_MESSAGES],
        2,
        None,
        f"line 2: shape 'messages/label' {SHAPES} 'prompt/completion/label' (line 1); use one shape per file",
    ),
    "feedback messages end with the judged completion": (
        [{"messages": [user(), assistant(), user()], "label": True}],
        1,
        "messages[2].role",
        "line 1: field 'messages[2].role': the last message must be the assistant's judged completion",
    ),
    "feedback messages are an array": (
        [{"messages": "x", "label": True}],
        1,
        "messages",
        "line 1: field 'messages': expected an array, got string",
    ),
    "a feedback prompt is text or messages": (
        [{"prompt": 3, "completion": "c", "label": True}],
        1,
        "prompt",
        "line 1: field 'prompt': expected a non-empty string or a list of messages, got number",
    ),
    "a prompt is a string or messages": (
        [PC, {"prompt": None, "completion": "c"}],
        2,
        "prompt",
        "line 2: field 'prompt': expected a non-empty string or a list of messages, got null",
    ),
    "a chat example needs an assistant message": (
        [CHAT, {"messages": [user(), user()]}],
        2,
        "messages",
        "line 2: field 'messages': no assistant message (a chat example needs at least one)",
    ),
    "a text part needs its text": (
        [{"messages": [{"role": "user", "content": [{"type": "text"}]}, assistant()]}],
        1,
        "messages[0].content[0].text",
        "line 1: field 'messages[0].content[0].text': missing",
    ),
    "a tool call's function is an object": (
        [{"messages": [user(), assistant("", tool_calls=[{**CALL, "function": "f"}]), assistant()]}],
        1,
        "messages[1].tool_calls[0].function",
        "line 1: field 'messages[1].tool_calls[0].function': expected an object, got string",
    ),
    "a tool call's function name is a string": (
        [{"messages": [user(), assistant("", tool_calls=[{**CALL, "function": {"name": 5}}]), assistant()]}],
        1,
        "messages[1].tool_calls[0].function.name",
        "line 1: field 'messages[1].tool_calls[0].function.name': expected a string, got number",
    ),
    "feedback messages need the prompt before the completion": (
        [{"messages": [assistant()], "label": True}],
        1,
        "messages",
        "line 1: field 'messages': needs the prompt's messages before the assistant's completion",
    ),
    "content is a non-empty string": (
        [{"messages": [user(""), assistant()]}],
        1,
        "messages[0].content",
        "line 1: field 'messages[0].content': must be a non-empty string",
    ),
    "a tool call is an object": (
        [{"messages": [user(), assistant("", tool_calls=["f"]), assistant()]}],
        1,
        "messages[1].tool_calls[0]",
        "line 1: field 'messages[1].tool_calls[0]': expected an object, got string",
    ),
    "a NUL is named with its field": (
        [{"text": "a\u0000b"}],
        1,
        "text",
        "line 1: field 'text': must not contain a NUL character",
    ),
}


@pytest.mark.parametrize("case", list(EXACT_ERRORS))
def test_exact_error(case: str) -> None:
    rows, line, field, message = EXACT_ERRORS[case]
    exc = error(jl(*rows))
    assert (exc.line, exc.field, str(exc)) == (line, field, message)


@pytest.mark.parametrize(
    "rows",
    [
        # content next to tool_calls is allowed; so is a tool call without arguments
        [{"messages": [user(), assistant("calling", tool_calls=[CALL]), TOOL_REPLY, assistant()]}],
        [
            {
                "messages": [
                    user(),
                    assistant("", tool_calls=[{**CALL, "function": {"name": "f"}}]),
                    TOOL_REPLY,
                    assistant(),
                ]
            }
        ],
    ],
)
def test_tool_call_shapes_that_are_valid(rows: list[Any]) -> None:
    assert validate(jl(*rows)).format is FileFormat.CHAT


def test_feedback_with_both_prompt_and_messages_is_read_by_its_prompt() -> None:
    both = {"messages": [user(), assistant()], **FEEDBACK}
    assert validate(jl(both, FEEDBACK)).format is FileFormat.UNPAIRED_PREFERENCE
    # its prompt/completion are what is checked: messages that would be refused alone are not looked at
    assert validate(jl({"messages": [assistant()], **FEEDBACK})).line_count == 1


def test_invalid_utf8_names_its_byte() -> None:
    exc = error(b'{"text": "\xc3\x28"}\n')  # byte 11 of the line starts a broken sequence
    assert str(exc) == "line 1: invalid UTF-8 at byte 11 of the line (invalid continuation byte)"


def test_limits_and_misuse_are_refused_with_their_names() -> None:
    with pytest.raises(ValueError, match=r"^min_examples must be at least 1$"):
        JsonlValidator(min_examples=0)
    with pytest.raises(ValueError, match=r"^max_line_bytes must be at least 1$"):
        JsonlValidator(max_line_bytes=0)
    assert validate(b'{"text": "x"}\n{"text": "y"}\n', max_line_bytes=14).line_count == 2
    assert JsonlValidator(max_line_bytes=1).max_line_bytes == 1
    validator = JsonlValidator()
    validator.feed(jl(TEXT))
    validator.finish()
    with pytest.raises(RuntimeError, match=r"^feed\(\) called after finish\(\)$"):
        validator.feed(b"x")


@pytest.mark.parametrize(("length", "crlf"), [(100, False), (100, True), (101, False), (101, True)])
def test_line_limit_holds_for_every_chunking(length: int, crlf: bool) -> None:
    """A line of exactly the limit passes and one byte more fails, wherever the chunks split it."""

    def line(n: int, end: bytes) -> bytes:
        body = json.dumps({"text": "x" * (n - len('{"text": ""}'))}).encode()
        assert len(body) == n
        return body + end

    data = line(100, b"\n") + line(length, b"\r\n" if crlf else b"\n") + line(100, b"\n")
    for size in range(1, len(data) + 1):
        got = outcome(data, size, max_line_bytes=100)
        if length == 100:
            assert isinstance(got, FileStats) and got.line_count == 3, size
        else:
            assert got == ("line 2: line is longer than 100 bytes", 2, None), size
