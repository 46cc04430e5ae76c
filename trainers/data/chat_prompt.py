"""A chat completion request's prompt: the conversation rendered by the model's own template with the
request's tools, the chat format its reply is read with, and the start of the reply that a ``tool_choice``
forces.

``tool_choice`` (OpenAI's): ``none`` renders no tools and reads no tool calls back; ``auto`` renders the
tools and reads the calls the model makes; ``required`` and ``function`` (a named function) begin the
reply with the template's own opening of a tool call (``prefill``), so the model writes a call: up to the
function's name for ``required``, up to its arguments for a named function. The opening is what the
template renders for an assistant message calling a probe function, cut where the probe's name (or
arguments) begins: Qwen's ``<tool_call>\\n{"name": "``, Llama 3.1's ``{"name": "get_weather",
"parameters": ``, gpt-oss's `` to=functions.get_weather<|channel|>commentary json<|message|>``. A
template that writes reasoning before a call (Qwen3) gets its empty reasoning block in the opening: a
forced call skips the reasoning.

Refusals are ``ChatDataError``s naming the request's parameter: ``tools`` (or ``functions``) where the
template does not render them or the model's chat format reads no tool calls, ``tool_choice`` where it
renders no tool call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from transformers import PreTrainedTokenizerBase

from trainers.chat.formats import ChatFormat, ToolChoice, detect_format
from trainers.chat.rows import Conversation
from trainers.data.chat import ChatDataError, prompt_text, render

_PROBE_NAME = "tunehouse_probe_function"
_PROBE_ARGUMENT = "tunehouse_probe_argument"


@dataclass(frozen=True)
class ChatPrompt:
    text: str  # the rendered conversation with its generation prompt, then the prefill
    prefill: str  # the start of the reply the prompt forces ("" unless a tool call is forced)
    format: ChatFormat  # the model's chat format: how the reply is read back
    tool_calls: bool  # whether the reply's tool calls are read (else they are content as written)


def chat_format(tokenizer: PreTrainedTokenizerBase) -> ChatFormat:
    """The chat format the tokenizer's template writes (``trainers.chat.formats.detect_format``)."""
    template = tokenizer.chat_template
    return detect_format(template if isinstance(template, str) else None)


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    chat: Conversation,
    *,
    tool_choice: ToolChoice = "auto",
    function: str | None = None,
) -> ChatPrompt:
    """The prompt for the reply to ``chat`` (with its tools) under ``tool_choice`` (``function``: the
    function a ``"function"`` choice names)."""
    fmt = chat_format(tokenizer)
    if tool_choice == "none" or not chat.tools:
        return ChatPrompt(prompt_text(tokenizer, replace(chat, tools=None)), "", fmt, tool_calls=False)
    if not fmt.tool_calls:
        raise ChatDataError(
            chat.tools_field,
            f"tool calls are not read back from this model's chat format ({fmt.name}: {fmt.families}); "
            "only hermes, llama3_json and harmony templates are",
        )
    text = prompt_text(tokenizer, chat)  # refuses tools the template does not render
    if tool_choice == "auto":
        return ChatPrompt(text, "", fmt, tool_calls=True)
    prefill = tool_call_opening(tokenizer, chat, text, function if tool_choice == "function" else None)
    return ChatPrompt(text + prefill, prefill, fmt, tool_calls=True)


def tool_call_opening(
    tokenizer: PreTrainedTokenizerBase, chat: Conversation, prompt: str, function: str | None
) -> str:
    """What the template writes, after ``prompt`` (``chat`` rendered with its generation prompt), for an
    assistant message calling ``function`` up to its arguments; for ``function`` None, up to the name."""
    name = function or _PROBE_NAME
    call = {
        "id": "call_probe",
        "type": "function",
        "function": {"name": name, "arguments": {_PROBE_ARGUMENT: 0}},
    }
    probe = replace(
        chat,
        messages=[*chat.messages, {"role": "assistant", "content": "", "tool_calls": [call]}],
        weights=[*chat.weights, 0],
        paths=[*chat.paths, "tool_choice"],
    )
    full = render(tokenizer, probe, len(probe.messages), generation_prompt=False)
    reply = full[len(prompt) :] if full.startswith(prompt) else ""
    cut = reply.find(name) if function is None else reply.find('{"' + _PROBE_ARGUMENT)
    if cut < 0:
        raise ChatDataError("tool_choice", "the model's chat template does not render tool calls")
    return reply[:cut]
