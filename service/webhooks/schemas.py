"""Webhook API objects. An extension: OpenAI configures webhooks in its dashboard, not over the API;
the events themselves have OpenAI's shape (`{"object": "event", "id", "type", "created_at", "data"}`)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint
from service.webhooks.events import EVENT_TYPES

EventType = Literal[EVENT_TYPES]  # type: ignore[valid-type]  # built from the one list of types
MAX_URL_LENGTH = 2048

# What a receiver's URL may be, stated once for the server's check and the OpenAPI document (issue 56:
# the document's pattern let through URLs the server refused). RFC 3986 in ASCII: http or https, an
# optional user, a host name or IPv4 address (an IPv6 literal is not accepted: give the host a name), a
# port of at most 65535, then any path, query and fragment without spaces or control characters.
_HOST = r"[A-Za-z0-9\-._~!$&'()*+,;=%]+"
_PORT = r"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4})"
WEBHOOK_URL_PATTERN = (
    rf"^[Hh][Tt][Tt][Pp][Ss]?://(?:[A-Za-z0-9\-._~!$&'()*+,;=%:]*@)?{_HOST}(?::{_PORT})?"
    r"(?:[/?#][!-~]*)?$"
)


class WebhookCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        min_length=len("http://x"),
        max_length=MAX_URL_LENGTH,
        description="An http(s) URL that receives POSTed events",
        json_schema_extra={"pattern": WEBHOOK_URL_PATTERN},  # checked by `_http_url`, which says why
    )
    # None (the default): every event type
    events: Annotated[list[EventType], Field(min_length=1, max_length=len(EVENT_TYPES))] | None = None
    description: str | None = Field(default=None, max_length=500)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not re.fullmatch(WEBHOOK_URL_PATTERN, value):
            raise ValueError(
                "must be an http:// or https:// URL with a host name or IPv4 address, a port of at most "
                "65535, and no spaces or control characters"
            )
        return value


class WebhookEndpointObject(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    # null: subscribed to every event type
    events: list[str] | None
    description: str | None
    created_at: int

    @classmethod
    def of(cls, row: WebhookEndpoint) -> WebhookEndpointObject:
        return cls(
            id=row.id, url=row.url, events=row.events, description=row.description, created_at=row.created_at
        )


class WebhookEndpointCreated(WebhookEndpointObject):
    # shown here only: verify each request's `webhook-signature` with it (Standard Webhooks)
    secret: str

    @classmethod
    def created(cls, row: WebhookEndpoint) -> WebhookEndpointCreated:
        return cls(**WebhookEndpointObject.of(row).model_dump(), secret=row.secret)


class WebhookEndpointDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    deleted: bool = True


class AttemptObject(BaseModel):
    attempt: int
    started_at: float
    duration_ms: float
    # null when no HTTP answer came; `error` says why
    status_code: int | None
    error: str | None

    @classmethod
    def of(cls, row: WebhookAttempt) -> AttemptObject:
        return cls(
            attempt=row.attempt,
            started_at=row.started_at,
            duration_ms=row.duration_ms,
            status_code=row.status_code,
            error=row.error,
        )


class DeliveryObject(BaseModel):
    id: str
    object: Literal["webhook.delivery"] = "webhook.delivery"
    event_id: str
    event_type: str
    status: Literal["pending", "delivered", "failed"]
    created_at: int
    delivered_at: int | None
    # when a pending delivery is tried next (unix seconds)
    next_attempt_at: float | None
    last_status_code: int | None
    last_error: str | None
    # the event as sent (the request body)
    event: dict[str, Any]
    attempts: list[AttemptObject]

    @classmethod
    def of(cls, row: WebhookDelivery, attempts: list[WebhookAttempt]) -> DeliveryObject:
        return cls(
            id=row.id,
            event_id=row.event_id,
            event_type=row.event_type,
            status=row.status,  # type: ignore[arg-type]  # the column holds only these three
            created_at=row.created_at,
            delivered_at=row.delivered_at,
            next_attempt_at=row.next_attempt_at if row.status == "pending" else None,
            last_status_code=row.last_status_code,
            last_error=row.last_error,
            event=row.payload,
            attempts=[AttemptObject.of(a) for a in attempts],
        )
