"""A chat completions request's conversation, tools and tool choice, read before anything is sent.

The messages and tools are OpenAI's chat row, read by `trainers.chat.rows.read_chat` into the form chat
templates read (a problem is a 400 naming it: `messages[2].tool_calls[0].function.arguments`); the
worker renders them with the model's template and reads the reply back with its chat format
(trainers/data/chat_prompt.py). The tool choice comes from `tool_choice`, or the legacy `function_call`
beside `functions`, whose reply is OpenAI's legacy `function_call` (one call) instead of `tool_calls`.
"""

from __future__ import annotations

from typing import Any, Literal

from service.errors import BadRequest
from service.inference.schemas import ChatCompletionRequest, FunctionName, NamedToolChoice
from service.inference.task import ChatRequest
from trainers.chat.formats import ToolChoice
from trainers.chat.rows import RowProblem, read_chat


def read_request(request: ChatCompletionRequest) -> ChatRequest:
    """The request's chat, or BadRequest naming what is wrong."""
    source: dict[str, Any] = {
        "tools": request.tools,
        "functions": request.functions,
        "parallel_tool_calls": request.parallel_tool_calls,
    }
    try:
        chat = read_chat([m.row() for m in request.messages], "messages", tools_from=source)
    except RowProblem as exc:
        param = exc.field or "messages"
        raise BadRequest(f"{param}: {exc.message}", param=param, code="invalid_value") from exc
    legacy = request.functions is not None
    choice, name = _tool_choice(request, {t["function"]["name"] for t in chat.tools or ()})
    return ChatRequest(
        messages=chat.messages,
        tools=chat.tools,
        tools_field=chat.tools_field,
        tool_choice=choice,
        tool_name=name,
        single_tool_call=legacy or request.parallel_tool_calls is False,
        legacy_functions=legacy,
        images=[image.url for image in chat.images],
    )


def _tool_choice(request: ChatCompletionRequest, names: set[str]) -> tuple[ToolChoice, str | None]:
    """The choice asked (the default: auto with tools, none without), checked against the tools."""
    asked: Literal["none", "auto", "required"] | NamedToolChoice | FunctionName | None = request.tool_choice
    param, tools = "tool_choice", "tools"
    if request.function_call is not None:
        if request.tool_choice is not None:
            raise BadRequest(
                "function_call: give either tool_choice or the legacy function_call, not both",
                param="function_call",
                code="invalid_value",
            )
        asked, param, tools = request.function_call, "function_call", "functions"
    if asked is None:
        return ("auto" if names else "none"), None
    if not names:
        raise BadRequest(f"{param}: only allowed when {tools} are given", param=param, code="invalid_value")
    if isinstance(asked, str):
        return asked, None
    name = asked.function.name if isinstance(asked, NamedToolChoice) else asked.name
    if name not in names:
        where = f"{param}.function.name" if isinstance(asked, NamedToolChoice) else f"{param}.name"
        known = ", ".join(sorted(names))
        raise BadRequest(
            f"{where}: {name!r} is not one of the {tools} ({known})", param=where, code="invalid_value"
        )
    return "function", name
