"""A row's prompt and completions as conversations: preference pairs (DPO, reward models), unpaired
feedback (KTO) and SFT's conversational prompt/completion rows. The upload validator and the trainers
read them with these functions, so a row the API accepts is a row the trainer reads the same way.

When the prompt and every completion are strings the row is a text pair (``BOS + prompt``,
``completion + EOS``) and these return None; when any is a message list, a string prompt is one user
message and a string completion one assistant message, the prompt's turns are context (weight 0), and
each completion continues the prompt's conversation (its tool calls answer the prompt's, its tools are
the row's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainers.chat.rows import Conversation, RowProblem, continue_chat, json_type, read_chat

Conversations = tuple[Conversation, list[Conversation]]  # (the prompt, each completion after it)


def as_messages(value: Any, path: str, role: str) -> Any:
    """A string as one message of ``role``; a list as it is (``read_chat`` checks it)."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list):
        raise RowProblem(path, f"expected a non-empty string or a list of messages, got {json_type(value)}")
    return value


def prompt_and_completions(
    prompt: Any,
    completions: Mapping[str, Any],
    *,
    tools_from: Mapping[str, Any] | None,
    prompt_path: str = "prompt",
    tools_prefix: str = "",
    assistant_outputs: bool = False,
    completion_start: int = 0,
) -> Conversations | None:
    """The prompt and each completion (``completions``: field name -> value) as conversations, or None
    for a text pair. ``assistant_outputs``: every completion message must be the assistant's;
    ``completion_start``: the index of a completion's first message in its field (for errors)."""
    if not any(isinstance(v, list) for v in (prompt, *completions.values())):
        for path, value in ((prompt_path, prompt), *completions.items()):
            as_messages(value, path, "")  # a string, or the error a list would not have
        return None
    messages = as_messages(prompt, prompt_path, "user")
    context = read_chat(messages, prompt_path, tools_from=tools_from, tools_prefix=tools_prefix)
    context.weights = [0] * len(context.weights)  # a prompt's turns are its context
    outputs = [
        continue_chat(
            context,
            as_messages(value, name, "assistant"),
            name,
            only_assistant=assistant_outputs,
            start=completion_start,
        )
        for name, value in completions.items()
    ]
    return context, outputs


def preference_pair(row: Mapping[str, Any], *, openai_shape: bool) -> Conversations | None:
    """A preference row's prompt, chosen and rejected: OpenAI's ``{"input": {"messages", "tools"},
    "preferred_output", "non_preferred_output"}`` (the outputs assistant messages) or ``{"prompt",
    "chosen", "rejected"}`` (with ``tools`` beside them)."""
    if openai_shape:
        source = _require(row, "input", "input")
        if not isinstance(source, dict):
            raise RowProblem("input", f"expected an object, got {json_type(source)}")
        for key in ("preferred_output", "non_preferred_output"):
            if not isinstance(_require(row, key, key), list):
                raise RowProblem(key, f"expected an array of assistant messages, got {json_type(row[key])}")
        return prompt_and_completions(
            _require(source, "messages", "input.messages"),
            {key: _require(row, key, key) for key in ("preferred_output", "non_preferred_output")},
            tools_from=source,
            prompt_path="input.messages",
            tools_prefix="input.",
            assistant_outputs=True,
        )
    return prompt_and_completions(
        _require(row, "prompt", "prompt"),
        {key: _require(row, key, key) for key in ("chosen", "rejected")},
        tools_from=row,
    )


def unpaired_example(row: Mapping[str, Any], *, messages_shape: bool) -> Conversations | None:
    """A KTO row's prompt and judged completion: ``{"messages": [..., assistant], "label"}`` (the last
    message is the completion) or ``{"prompt", "completion", "label"}``."""
    if not messages_shape:
        return prompt_and_completions(
            _require(row, "prompt", "prompt"),
            {"completion": _require(row, "completion", "completion")},
            tools_from=row,
            assistant_outputs=True,
        )
    messages = _require(row, "messages", "messages")
    if not isinstance(messages, list):
        raise RowProblem("messages", f"expected an array, got {json_type(messages)}")
    if len(messages) < 2:
        raise RowProblem("messages", "needs the prompt's messages before the assistant's completion")
    last = len(messages) - 1
    if not isinstance(messages[last], dict) or messages[last].get("role") != "assistant":
        raise RowProblem(
            f"messages[{last}].role", "the last message must be the assistant's judged completion"
        )
    return prompt_and_completions(
        messages[:last],
        {"messages": messages[last:]},
        tools_from=row,
        prompt_path="messages",
        completion_start=last,
    )


def _require(row: Mapping[str, Any], key: str, path: str) -> Any:
    if key not in row:
        raise RowProblem(path, "missing")
    return row[key]
