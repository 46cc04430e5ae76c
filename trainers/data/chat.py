"""A conversation rendered by the model's own chat template, as the model sees it at inference time.

Rows are read by ``trainers.chat.rows`` (messages, tool calls, reasoning and ``tools`` in the form
templates read) and rendered here with ``tokenizer.apply_chat_template`` and the row's tools.

**Which tokens train.** Assistant turn *i* (weight 1) trains on what the template adds when it renders
the conversation up to and including turn *i*, after the prompt it renders for generating turn *i*
(messages before *i*, ``add_generation_prompt=True``): exactly what the model must produce at inference
time, in exactly the context it gets then.

**One sequence, or several.** Where the whole conversation's rendering starts with each turn's rendering
(most templates), the turns train in one sequence. Some templates render earlier turns differently once
later ones follow: Qwen3 drops the reasoning of turns before the last user message, gpt-oss ends an
earlier final answer with ``<|end|>`` instead of ``<|return|>`` and drops its analysis. A turn whose
rendering the next turns' context does not extend then starts a sequence of its own: the conversation
trains as several sequences, each turn in its inference-time context. (TRL's ``assistant_only_loss``
trains the whole conversation in one rendering with the training template's ``{% generation %}``
markers; for these turns it trains text the model never produces at inference: docs/data-formats.md.)

**Nothing dropped silently.** A template that does not render part of a message (reasoning, a tool
call, content beside a tool call, a tool's schema) or refuses the row (``raise_exception``) fails the row
with a ``DataError`` naming the field; nothing trains without it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from trainers.chat.pairs import Conversations
from trainers.chat.rows import Conversation, Message, RowProblem
from trainers.core.errors import DataError

Segment = tuple[str, bool]  # (text, trainable)


class ChatDataError(DataError):
    """A row the model's chat template cannot train as given; ``field`` names what (``messages[2]...``),
    ``reason`` says why (the message is both, as a training file's errors read)."""

    def __init__(self, field: str | None, reason: str) -> None:
        super().__init__(f"field {field!r}: {reason}" if field else reason)
        self.field, self.reason = field, reason


@contextmanager
def read_errors() -> Iterator[None]:
    """``RowProblem`` (a malformed row) as ``ChatDataError``."""
    try:
        yield
    except RowProblem as exc:
        raise ChatDataError(exc.field, exc.message) from exc


def render(
    tokenizer: PreTrainedTokenizerBase, chat: Conversation, end: int, *, generation_prompt: bool
) -> str:
    """``chat.messages[:end]`` as the template renders them, with the row's tools; a template's refusal
    (``raise_exception``, or its own bug on this row) as a ``ChatDataError`` naming the first message it
    refuses."""
    try:
        return _apply(tokenizer, chat, end, generation_prompt)
    except TemplateError as exc:
        refused = next((k for k in range(1, end + 1) if not _renders(tokenizer, chat, k)), None)
        field = None if refused is None else chat.paths[refused - 1]
        raise ChatDataError(field, f"the model's chat template refuses it: {exc}") from exc


def _apply(tokenizer: PreTrainedTokenizerBase, chat: Conversation, end: int, generation_prompt: bool) -> str:
    messages = chat.messages[:end]
    if reads_parts(tokenizer):  # (a message with images has its parts already)
        messages = [
            {**m, "content": as_parts(m["content"])} if isinstance(m["content"], str) else m for m in messages
        ]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **chat.template_kwargs()
    )
    assert isinstance(text, str)
    return text


def _renders(tokenizer: PreTrainedTokenizerBase, chat: Conversation, end: int) -> bool:
    try:
        _apply(tokenizer, chat, end, False)
    except TemplateError:
        return False
    return True


def as_parts(content: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": content}] if content else []


_PROBE = "tunehouse-probe"


def reads_parts(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's template reads message content only as a list of parts (LLaVA-Next's
    ``message['content'][0]['text']``) and not as a string, as most do: then every message's content is
    handed to it as one text part."""
    return _template_reads_parts(tokenizer, str(tokenizer.chat_template))


@functools.lru_cache(maxsize=32)
def _template_reads_parts(tokenizer: PreTrainedTokenizerBase, template: str) -> bool:
    def renders(content: object) -> bool:
        messages: Any = [{"role": "user", "content": content}]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except (TemplateError, TypeError, KeyError, IndexError):
            return False
        return isinstance(text, str) and _PROBE in text

    return not renders(_PROBE) and renders(as_parts(_PROBE))


@dataclass
class _Sequence:
    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)  # trained character spans, in order
    last_turn: int = -1  # the message whose rendering ends ``text``
    last_prompt: str = ""  # its generation prompt

    def segments(self) -> list[Segment]:
        out: list[Segment] = []
        done = 0
        for start, end in self.spans:
            out += [(self.text[done:start], False), (self.text[start:end], True)]
            done = end
        out.append((self.text[done:], False))
        return [s for s in out if s[0]]

    def extend(self, prompt: str, upto: str, i: int) -> None:
        self.text = upto
        self.spans.append((len(prompt), len(upto)))
        self.last_turn, self.last_prompt = i, prompt

    def drop_closing(self, closing: str) -> None:
        """Leave out ``closing``, what the template writes after the last turn of a conversation only."""
        self.text = self.text[: len(self.text) - len(closing)]
        start, _ = self.spans[-1]
        self.spans[-1] = (start, len(self.text))


def turn_text(tokenizer: PreTrainedTokenizerBase, chat: Conversation, i: int) -> tuple[str, str]:
    """(the prompt for generating assistant message ``i``, the rendering up to and including it)."""
    prompt = render(tokenizer, chat, i, generation_prompt=True)
    upto = render(tokenizer, chat, i + 1, generation_prompt=False)
    if not upto.startswith(prompt):
        raise ChatDataError(
            chat.paths[i],
            "the model's chat template renders this turn without the generation prompt it gives for it "
            "(an inference-only template, e.g. one that drops reasoning), so what trains would not be "
            "what the model produces",
        )
    return prompt, upto


def closing_text(
    tokenizer: PreTrainedTokenizerBase, chat: Conversation, i: int, prompt: str, upto: str
) -> str:
    """The EOS the template writes after assistant message ``i`` only because the conversation ends there
    (Phi-3.5's, after its ``<|end|>``), or "": it is such an EOS when the rendering that goes on to a
    generation prompt is the rendering without it plus the generation prompt's own text. gpt-oss's
    ``<|return|>`` is not: going on, it ends the turn with ``<|end|>`` instead, so the turn differs."""
    eos = tokenizer.eos_token
    if not isinstance(eos, str) or not eos or not upto.endswith(eos):
        return ""
    before = render(tokenizer, chat, i, generation_prompt=False)
    base = before[: len(before) - len(eos)] if before.endswith(eos) else before
    if not prompt.startswith(base) or len(prompt) == len(base):
        return ""
    cue = prompt[len(base) :]  # the generation prompt's own text
    going_on = render(tokenizer, chat, i + 1, generation_prompt=True)
    return eos if going_on == upto[: len(upto) - len(eos)] + cue else ""


def training_sequences(tokenizer: PreTrainedTokenizerBase, chat: Conversation) -> list[list[Segment]]:
    """The conversation as (text, trainable) segments, one list per sequence (the module's docstring)."""
    sequences: list[_Sequence] = []
    for i, weight in enumerate(chat.weights):
        if weight != 1:
            continue
        prompt, upto = turn_text(tokenizer, chat, i)
        require_rendered(upto[len(prompt) :], chat.messages[i], chat.paths[i], trained=True)
        last = sequences[-1] if sequences else None
        if last is not None and not upto.startswith(last.text):
            closing = closing_text(tokenizer, chat, last.last_turn, last.last_prompt, last.text)
            if closing and upto.startswith(last.text[: len(last.text) - len(closing)]):
                last.drop_closing(closing)
        if last is not None and upto.startswith(last.text) and len(prompt) >= len(last.text):
            last.extend(prompt, upto, i)
        else:
            sequences.append(_Sequence(upto))
            sequences[-1].extend(prompt, upto, i)
    if not sequences:
        return []
    full = render(tokenizer, chat, len(chat.messages), generation_prompt=False)
    if full.startswith(sequences[-1].text):
        sequences[-1].text = full  # what follows the last trained turn, untrained
    require_context(chat, full)
    return [s.segments() for s in sequences]


def prompt_text(tokenizer: PreTrainedTokenizerBase, chat: Conversation) -> str:
    """The conversation with the assistant's generation prompt (an RL prompt, a preference pair's)."""
    text = render(tokenizer, chat, len(chat.messages), generation_prompt=True)
    require_context(chat, text)
    return text


def completion_text(tokenizer: PreTrainedTokenizerBase, prompt: str, chat: Conversation, first: int) -> str:
    """What rendering ``chat`` (a prompt's messages, then a completion's from ``first`` on) adds to
    ``prompt``, its prompt's rendering with the generation prompt."""
    full = render(tokenizer, chat, len(chat.messages), generation_prompt=False)
    if not full.startswith(prompt):
        raise ChatDataError(
            chat.paths[first],
            "the model's chat template renders the prompt differently once this completion follows it",
        )
    added = full[len(prompt) :]
    for i in range(first, len(chat.messages)):
        if chat.messages[i]["role"] == "assistant":
            require_rendered(added, chat.messages[i], chat.paths[i], trained=True)
    return added


def conversation_texts(
    tokenizer: PreTrainedTokenizerBase, conversations: Conversations
) -> tuple[str, list[str]]:
    """A prompt's text (with its generation prompt) and what each completion adds to it."""
    prompt, completions = conversations
    text = prompt_text(tokenizer, prompt)
    return text, [completion_text(tokenizer, text, c, len(prompt.messages)) for c in completions]


def appears(text: str, rendered: str) -> bool:
    """Whether ``text`` is in ``rendered`` as it is or JSON-escaped (gpt-oss and Llama 3.1 write a tool
    result with ``tojson``)."""
    text = text.strip()
    return not text or text in rendered or json.dumps(text, ensure_ascii=False)[1:-1] in rendered


def require_rendered(rendered: str, message: Message, path: str, *, trained: bool) -> None:
    """``ChatDataError`` unless ``rendered`` holds what the template must render of ``message``: its
    content, and for a trained assistant turn its reasoning and each tool call (name and argument keys)."""
    calls = message.get("tool_calls", ())
    content = message.get("content", "")
    texts = [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]
    if not all(appears(text, rendered) for text in texts):
        beside = " beside tool_calls" if calls else ""
        raise ChatDataError(f"{path}.content", f"the model's chat template does not render content{beside}")
    if not trained or message["role"] != "assistant":
        return
    reasoning = message.get("reasoning_content")
    if reasoning and not appears(reasoning, rendered):
        raise ChatDataError(
            f"{path}.reasoning_content",
            "the model's chat template does not render reasoning (reasoning_content, reasoning or "
            "thinking); leave it out to train the answer alone",
        )
    for j, call in enumerate(calls):
        function = call["function"]
        keys = [json.dumps(k, ensure_ascii=False)[1:-1] for k in function["arguments"]]
        if function["name"] not in rendered or not all(k in rendered for k in keys):
            raise ChatDataError(
                f"{path}.tool_calls[{j}]", "the model's chat template does not render tool calls"
            )


def require_context(chat: Conversation, rendered: str) -> None:
    """``ChatDataError`` unless ``rendered`` (a whole conversation's rendering) holds the row's tools and
    the content of every message that does not train."""
    for tool in chat.tools or ():
        if tool["function"]["name"] not in rendered:
            raise ChatDataError(chat.tools_field, "the model's chat template does not render tools")
    for message, path, weight in zip(chat.messages, chat.paths, chat.weights, strict=True):
        if weight != 1:
            require_rendered(rendered, message, path, trained=False)
