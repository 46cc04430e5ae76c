"""Request bodies of `/v1/chat/completions` and `/v1/completions` in OpenAI's shapes.

Unknown parameters are refused (400 naming them) rather than silently ignored: a client asking for
`logprobs` must learn that this server does not do them. A chat request's messages and tools are OpenAI's
chat row, checked by `trainers.chat.rows.read_chat` (service/inference/chat.py): the types here are what
the OpenAPI document shows, the rules of how the fields go together are read_chat's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trainers.chat.rows import ROLES

# OpenAI's own limits: at most 4 stop sequences; n is ours (choices are one batch on one worker)
MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 16
# A seed is any integer a JSON number holds exactly in every client: I-JSON's range (RFC 7493), which a
# double represents exactly. Past it a client may send a number other than the one it meant, and a
# schema's 64-bit bound is not exact either (Schemathesis sent 2**63 + 190 as a valid seed: issue 56)
EXACT_JSON_INT = 2**53 - 1


def _stop_schema(schema: dict[str, Any]) -> None:
    """The OpenAPI document states the `_stop_list` bound on the list branch. (In the type, as
    `Annotated[list[str], Field(max_length=4)]`, a refusal would name the union's branch, `stop.str`.)"""
    for branch in schema.get("anyOf", []):
        if branch.get("type") == "array":
            branch["maxItems"] = MAX_STOP_SEQUENCES


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(min_length=1)
    detail: Literal["low", "high", "auto"] = "auto"


class ImagePart(BaseModel):
    """An image for a vision model (docs/vision.md): a base64 data URL, or an http(s) URL the API fetches
    (service/inference/images.py); user and system messages only."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    """A message of the conversation: an assistant's may carry `tool_calls` (its content then null) and
    reasoning, a tool message answers a call (`tool_call_id`). `refusal` is accepted (null) so that a
    reply appended to the conversation as the client got it can be sent back."""

    model_config = ConfigDict(extra="forbid")
    role: str = Field(json_schema_extra={"enum": list(ROLES)})
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None  # OpenAI's legacy single call
    reasoning_content: str | None = None
    reasoning: str | None = None
    thinking: str | None = None
    refusal: str | None = None

    @property
    def images(self) -> list[ImagePart]:
        """Its image parts (a vision model's: service/inference/images.py checks them)."""
        return [p for p in self.content if isinstance(p, ImagePart)] if isinstance(self.content, list) else []

    def row(self) -> dict[str, Any]:
        """The message as OpenAI's chat row has it, for read_chat."""
        return self.model_dump(exclude_none=True, exclude={"refusal"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=600)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = Field(default=None, json_schema_extra=_stop_schema)
    seed: int | None = Field(default=None, ge=-EXACT_JSON_INT, le=EXACT_JSON_INT)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)  # accepted, as OpenAI's; not used

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def wanted_tokens(self) -> tuple[int | None, str]:
        """The token limit asked for and the parameter that asked."""
        return self.max_tokens, "max_tokens"


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: the reply calls this function."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = Field(
        default=None,
        description='`[{"type": "function", "function": {"name", "description", "parameters"}}]`',
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = Field(
        default=None, description="OpenAI's legacy tools: `[{name, description, parameters}]`"
    )
    function_call: Literal["none", "auto"] | FunctionName | None = None
    # OpenAI's newer name for max_tokens; it wins when both are given
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def wanted_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(SamplingRequest):
    prompt: str
