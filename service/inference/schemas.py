"""Request bodies of `/v1/chat/completions` and `/v1/completions` in OpenAI's shapes.

Unknown parameters are refused (400 naming them) rather than silently ignored: a client asking for
`logprobs` or `tools` must learn that this server does not do them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# OpenAI's own limits: at most 4 stop sequences; n is ours (choices are one batch on one worker)
MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 16


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
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart | ImagePart]
    name: str | None = None

    @property
    def images(self) -> list[ImagePart]:
        return [p for p in self.content if isinstance(p, ImagePart)] if isinstance(self.content, list) else []

    def plain(self) -> dict[str, Any]:
        """Role and text as chat templates expect them (`developer` is OpenAI's new `system`); a message
        with images keeps OpenAI's parts, which the worker reads as training reads a row's
        (``trainers.chat.rows``)."""
        role = "system" if self.role == "developer" else self.role
        if self.images:
            assert isinstance(self.content, list)
            return {"role": role, "content": [p.model_dump() for p in self.content]}
        text = (
            self.content
            if isinstance(self.content, str)
            else "".join(p.text for p in self.content if isinstance(p, TextPart))
        )
        return {"role": role, "content": text}


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
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
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


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # OpenAI's newer name for max_tokens; it wins when both are given
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def wanted_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(SamplingRequest):
    prompt: str
