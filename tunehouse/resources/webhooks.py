"""`client.webhooks`: endpoints that receive signed job events (a tunehouse extension), and their
delivery logs.

Each method is written once, for both clients (see `tunehouse._resource`)."""

from __future__ import annotations

from tunehouse._base_client import IDEMPOTENCY_HEADER, APIRequest, compact, new_idempotency_key, raw
from tunehouse._pagination import PageRequest
from tunehouse._resource import AsyncAPIResource, SyncAPIResource, endpoint, paged, parse_as
from tunehouse.types import WebhookDelivery, WebhookEndpoint, WebhookEndpointDeleted

PATH = "/v1/webhooks"


class _Webhooks:
    @endpoint
    def create(
        self,
        *,
        url: str,
        events: list[str] | None = None,
        description: str | None = None,
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> APIRequest[WebhookEndpoint]:
        """The answer's `secret` verifies the requests' signatures; it is shown only here.

        Sent with an `Idempotency-Key` but never retried automatically: the server does not deduplicate
        this POST, so a repeat would create a second endpoint with another secret."""
        key = idempotency_key or new_idempotency_key()
        return APIRequest(
            "POST",
            PATH,
            parse_as(WebhookEndpoint),
            json=compact(url=url, events=events, description=description),
            headers={IDEMPOTENCY_HEADER: key},
            timeout=timeout,
        )

    @paged
    def list(
        self, *, after: str | None = None, limit: int | None = None, timeout: float | None = None
    ) -> PageRequest[WebhookEndpoint]:
        params = compact(after=after, limit=limit)
        return PageRequest(raw("GET", PATH, params=params, timeout=timeout), WebhookEndpoint)

    @endpoint
    def retrieve(self, webhook_id: str, *, timeout: float | None = None) -> APIRequest[WebhookEndpoint]:
        return APIRequest("GET", f"{PATH}/{webhook_id}", parse_as(WebhookEndpoint), timeout=timeout)

    @endpoint
    def delete(self, webhook_id: str, *, timeout: float | None = None) -> APIRequest[WebhookEndpointDeleted]:
        return APIRequest("DELETE", f"{PATH}/{webhook_id}", parse_as(WebhookEndpointDeleted), timeout=timeout)

    @paged
    def list_deliveries(
        self,
        webhook_id: str,
        *,
        status: str | None = None,
        after: str | None = None,
        limit: int | None = None,
        timeout: float | None = None,
    ) -> PageRequest[WebhookDelivery]:
        params = compact(status=status, after=after, limit=limit)
        url = f"{PATH}/{webhook_id}/deliveries"
        return PageRequest(raw("GET", url, params=params, timeout=timeout), WebhookDelivery)


class Webhooks(_Webhooks, SyncAPIResource):
    pass


class AsyncWebhooks(_Webhooks, AsyncAPIResource):
    pass
