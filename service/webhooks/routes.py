"""HTTP routes for /v1/webhooks (an extension): parse, authorize, call the service."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.auth import TenantDep
from service.dependencies import After, Limit, SessionDep
from service.errors import error_responses
from service.pagination import list_body
from service.webhooks import service
from service.webhooks.schemas import (
    DeliveryObject,
    WebhookCreate,
    WebhookEndpointCreated,
    WebhookEndpointDeleted,
    WebhookEndpointObject,
)

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"], responses=error_responses(400, 401, 503))
_ONE = error_responses(404)


@router.post("", response_model=WebhookEndpointCreated)
def create_webhook(spec: WebhookCreate, session: SessionDep, tenant: TenantDep) -> WebhookEndpointCreated:
    """The answer carries the signing `secret`; it is never shown again."""
    return WebhookEndpointCreated.created(service.create_endpoint(session, tenant=tenant, spec=spec))


@router.get("")
def list_webhooks(
    session: SessionDep, tenant: TenantDep, after: After = None, limit: Limit = 20
) -> dict[str, Any]:
    rows, has_more = service.list_endpoints(session, tenant=tenant, after=after, limit=limit)
    return list_body([WebhookEndpointObject.of(r).model_dump() for r in rows], has_more)


@router.get("/{webhook_id}", response_model=WebhookEndpointObject, responses=_ONE)
def retrieve_webhook(webhook_id: str, session: SessionDep, tenant: TenantDep) -> WebhookEndpointObject:
    return WebhookEndpointObject.of(service.get_endpoint(session, tenant=tenant, webhook_id=webhook_id))


@router.delete("/{webhook_id}", response_model=WebhookEndpointDeleted, responses=_ONE)
def delete_webhook(webhook_id: str, session: SessionDep, tenant: TenantDep) -> WebhookEndpointDeleted:
    service.delete_endpoint(session, tenant=tenant, webhook_id=webhook_id)
    return WebhookEndpointDeleted(id=webhook_id)


@router.get("/{webhook_id}/deliveries", responses=_ONE)
def list_deliveries(
    webhook_id: str,
    session: SessionDep,
    tenant: TenantDep,
    after: After = None,
    limit: Limit = 20,
    status: service.DeliveryStatus | None = None,
) -> dict[str, Any]:
    """The delivery log, newest first: each event's status, attempts, status codes and errors."""
    endpoint = service.get_endpoint(session, tenant=tenant, webhook_id=webhook_id)
    rows, has_more = service.list_deliveries(
        session, endpoint=endpoint, after=after, limit=limit, status=status
    )
    return list_body([DeliveryObject.of(d, a).model_dump() for d, a in rows], has_more)
