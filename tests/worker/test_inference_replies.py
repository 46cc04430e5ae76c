"""worker/inference.py's ``ChoiceReply``: one choice's text, as the model writes it, into the pieces the API
streams (service/inference/task.py's protocol) and its finish reason — ``tool_calls`` where it called a
tool, its one call ending it where only one is asked for, a forced opening read before the model's text."""

from __future__ import annotations

from typing import Any

from trainers.chat.formats import HERMES
from trainers.data.chat_prompt import ChatPrompt
from worker.inference import ChoiceReply

PROMPT = "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'


def read(
    reply: ChoiceReply, pieces: list[str], reason: str | None
) -> tuple[list[dict[str, Any]], str | None]:
    out: list[dict[str, Any]] = []
    finish = None
    for i, text in enumerate(pieces):
        got, finish = reply.read(text, reason if i == len(pieces) - 1 else None)
        out += got
    return out, finish


def test_reasoning_content_and_calls_in_the_order_written() -> None:
    reply = ChoiceReply(ChatPrompt(PROMPT, "", HERMES, tool_calls=True), single_call=False)
    text = "<think>\nHm.\n</think>\n\nChecking.\n" + CALL % "Paris" + "\n" + CALL % "Rome"
    pieces, finish = read(reply, list(text), "stop")
    assert finish == "tool_calls"
    assert "".join(p.get("reasoning_content", "") for p in pieces) == "Hm."
    assert "".join(p.get("content", "") for p in pieces) == "Checking."
    calls = [p["tool_call"] for p in pieces if "tool_call" in p]
    assert [(c["index"], c["name"], c["arguments"]) for c in calls] == [
        (0, "get_weather", '{"city": "Paris"}'),
        (1, "get_weather", '{"city": "Rome"}'),
    ]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    kinds = [next(iter(p)) for p in pieces]
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning_content")


def test_a_reply_cut_by_the_token_limit_keeps_its_reason() -> None:
    reply = ChoiceReply(ChatPrompt(PROMPT, "", HERMES, tool_calls=True), single_call=False)
    pieces, finish = read(reply, [CALL % "Paris", '\n<tool_call>\n{"name": "get'], "length")
    assert finish == "length"  # a call was made, but the reply did not end: OpenAI says length
    assert pieces[-1] == {"content": '<tool_call>\n{"name": "get'}  # the cut call, as written


def test_a_single_call_reply_ends_at_its_first_call() -> None:
    reply = ChoiceReply(ChatPrompt(PROMPT, "", HERMES, tool_calls=True), single_call=True)
    pieces, finish = reply.read(CALL % "Paris" + "\n" + CALL % "Rome", None)
    assert finish == "tool_calls" and reply.ended  # the worker ends the choice's generation
    assert [p["tool_call"]["arguments"] for p in pieces] == ['{"city": "Paris"}']
    assert reply.read("More.", "stop") == ([], None)  # nothing after it belongs to the reply


def test_a_forced_opening_is_read_before_the_model_s_text() -> None:
    opening = '<tool_call>\n{"name": "get_weather", "arguments": '
    reply = ChoiceReply(ChatPrompt(PROMPT + opening, opening, HERMES, tool_calls=True), single_call=False)
    pieces, finish = read(reply, ['{"city": ', '"Paris"}}\n</tool_call>'], "stop")
    assert finish == "tool_calls"
    assert [p["tool_call"]["name"] for p in pieces] == ["get_weather"]


def test_calls_are_content_where_none_may_be_made() -> None:
    reply = ChoiceReply(ChatPrompt(PROMPT, "", HERMES, tool_calls=False), single_call=False)
    pieces, finish = read(reply, [CALL % "Paris"], "stop")
    assert finish == "stop" and pieces == [{"content": CALL % "Paris"}]
