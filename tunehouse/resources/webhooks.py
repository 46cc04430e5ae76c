"""`client.webhooks`: endpoints that receive signed job events (a tunehouse extension), and their
delivery logs."""

from __future__ import annotations

from typing import Any

from tunehouse._base_client import AsyncTransport, SyncTransport
from tunehouse._pagination import AsyncPage, SyncPage
from tunehouse.types import WebhookDelivery, WebhookEndpoint, WebhookEndpointDeleted

PATH = "/v1/webhooks"


def _body(url: str, events: list[str] | None, description: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"url": url, "events": events, "description": description}
    return {k: v for k, v in body.items() if v is not None}


def _params(**params: Any) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}


class Webhooks:
    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport

    def create(
        self, *, url: str, events: list[str] | None = None, description: str | None = None
    ) -> WebhookEndpoint:
        """The answer's `secret` verifies the requests' signatures; it is shown only here."""
        response = self._t.request("POST", PATH, json=_body(url, events, description))
        return WebhookEndpoint.model_validate(response.json())

    def list(self, *, after: str | None = None, limit: int | None = None) -> SyncPage[WebhookEndpoint]:
        body = self._t.request("GET", PATH, params=_params(after=after, limit=limit)).json()
        return SyncPage(
            [WebhookEndpoint.model_validate(x) for x in body["data"]],
            body["has_more"],
            lambda cursor: self.list(after=cursor, limit=limit),
        )

    def retrieve(self, webhook_id: str) -> WebhookEndpoint:
        return WebhookEndpoint.model_validate(self._t.request("GET", f"{PATH}/{webhook_id}").json())

    def delete(self, webhook_id: str) -> WebhookEndpointDeleted:
        return WebhookEndpointDeleted.model_validate(self._t.request("DELETE", f"{PATH}/{webhook_id}").json())

    def list_deliveries(
        self,
        webhook_id: str,
        *,
        status: str | None = None,
        after: str | None = None,
        limit: int | None = None,
    ) -> SyncPage[WebhookDelivery]:
        params = _params(status=status, after=after, limit=limit)
        body = self._t.request("GET", f"{PATH}/{webhook_id}/deliveries", params=params).json()
        return SyncPage(
            [WebhookDelivery.model_validate(x) for x in body["data"]],
            body["has_more"],
            lambda cursor: self.list_deliveries(webhook_id, status=status, after=cursor, limit=limit),
        )


class AsyncWebhooks:
    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport

    async def create(
        self, *, url: str, events: list[str] | None = None, description: str | None = None
    ) -> WebhookEndpoint:
        response = await self._t.request("POST", PATH, json=_body(url, events, description))
        return WebhookEndpoint.model_validate(response.json())

    async def list(self, *, after: str | None = None, limit: int | None = None) -> AsyncPage[WebhookEndpoint]:
        body = (await self._t.request("GET", PATH, params=_params(after=after, limit=limit))).json()
        return AsyncPage(
            [WebhookEndpoint.model_validate(x) for x in body["data"]],
            body["has_more"],
            lambda cursor: self.list(after=cursor, limit=limit),
        )

    async def retrieve(self, webhook_id: str) -> WebhookEndpoint:
        return WebhookEndpoint.model_validate((await self._t.request("GET", f"{PATH}/{webhook_id}")).json())

    async def delete(self, webhook_id: str) -> WebhookEndpointDeleted:
        response = await self._t.request("DELETE", f"{PATH}/{webhook_id}")
        return WebhookEndpointDeleted.model_validate(response.json())

    async def list_deliveries(
        self,
        webhook_id: str,
        *,
        status: str | None = None,
        after: str | None = None,
        limit: int | None = None,
    ) -> AsyncPage[WebhookDelivery]:
        params = _params(status=status, after=after, limit=limit)
        body = (await self._t.request("GET", f"{PATH}/{webhook_id}/deliveries", params=params)).json()
        return AsyncPage(
            [WebhookDelivery.model_validate(x) for x in body["data"]],
            body["has_more"],
            lambda cursor: self.list_deliveries(webhook_id, status=status, after=cursor, limit=limit),
        )
