"""A sampled completion as the reward functions get it, and OpenAI's ``sample`` namespace of it.

Reward functions stay plain callables ``(prompts, completions, **columns)``: each completion is a
``Completion``, a ``str`` (the text the model wrote, its chat format's markup included, as any reward
function reads it) that also carries what the model's chat format (``trainers.chat.formats``) read from
it. Graders read it as OpenAI's graders read a sample:

- ``output_text``: the reply's content, without its reasoning or tool-call markup;
- ``output_tools``: the reply's tool calls as ``choices[0].message.tool_calls`` of a chat completion,
  ``[{"id", "type": "function", "function": {"name", "arguments"}}]``, the arguments a JSON string.

A plain string (a reward function called by hand, ``/v1/fine_tuning/alpha/graders/run``'s
``model_sample``) is a reply whose content is the string and that calls no tool.

>>> from trainers.chat.formats import HERMES
>>> text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
>>> sample = sample_namespace(Completion.read(text, HERMES))
>>> sample["output_text"], sample["output_tools"][0]["function"]
('', {'name': 'get_weather', 'arguments': '{"city": "Paris"}'})
>>> sample_namespace("Lima")
{'output_text': 'Lima', 'output_tools': []}
"""

from __future__ import annotations

from typing import Any

from trainers.chat.formats import ChatFormat, Reply

SAMPLE_FIELDS = ("output_text", "output_tools")
"""The variables of the ``sample`` namespace graders may read."""


class Completion(str):
    """The text of a sampled completion, with ``reply``: what its chat format read from it."""

    reply: Reply

    def __new__(cls, text: str, reply: Reply | None = None) -> Completion:
        self = super().__new__(cls, text)
        self.reply = Reply(content=text) if reply is None else reply
        return self

    @classmethod
    def read(cls, text: str, fmt: ChatFormat, prompt: str = "") -> Completion:
        """``text`` (written after ``prompt``) read with the chat format ``fmt``."""
        return cls(text, fmt.parse(text, prompt))


def sample_namespace(completion: str) -> dict[str, Any]:
    """OpenAI's ``sample`` of ``completion`` (the module's docstring)."""
    reply = completion.reply if isinstance(completion, Completion) else Reply(content=completion)
    tools = [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for i, call in enumerate(reply.tool_calls)
    ]
    return {"output_text": reply.content, "output_tools": tools}
