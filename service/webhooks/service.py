"""Rules for webhook endpoints: create (with a secret shown once), list, delete, read the delivery log;
every read scoped to the tenant (another tenant's endpoint is a 404)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.errors import NotFound
from service.ids import new_id
from service.models import Tenant, WebhookAttempt, WebhookDelivery, WebhookEndpoint
from service.pagination import page
from service.webhooks.schemas import WebhookCreate
from service.webhooks.signing import new_secret

DeliveryStatus = Literal["pending", "delivered", "failed"]


def create_endpoint(session: Session, *, tenant: Tenant, spec: WebhookCreate) -> WebhookEndpoint:
    row = WebhookEndpoint(
        id=new_id("wh"),
        tenant_id=tenant.id,
        url=spec.url,
        # stored in the declared order, duplicates dropped
        events=list(dict.fromkeys(spec.events)) if spec.events is not None else None,
        description=spec.description,
        secret=new_secret(),
    )
    session.add(row)
    session.flush()
    return row


def get_endpoint(session: Session, *, tenant: Tenant, webhook_id: str) -> WebhookEndpoint:
    row = session.scalar(
        select(WebhookEndpoint).where(
            WebhookEndpoint.id == webhook_id, WebhookEndpoint.tenant_id == tenant.id
        )
    )
    if row is None:
        raise NotFound(
            f"No such webhook endpoint: {webhook_id}", param="webhook_id", code="webhook_not_found"
        )
    return row


def list_endpoints(
    session: Session, *, tenant: Tenant, after: str | None, limit: int
) -> tuple[Sequence[WebhookEndpoint], bool]:
    stmt = select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant.id)
    return page(session, stmt, WebhookEndpoint.id, after=after, limit=limit)


def delete_endpoint(session: Session, *, tenant: Tenant, webhook_id: str) -> None:
    """Its pending deliveries go with it (nothing is sent to an endpoint after its deletion commits)."""
    row = get_endpoint(session, tenant=tenant, webhook_id=webhook_id)
    # explicit deletes, children first: SQLite enforces the ON DELETE CASCADE only with foreign_keys on
    deliveries = select(WebhookDelivery.id).where(WebhookDelivery.endpoint_id == row.id)
    session.execute(delete(WebhookAttempt).where(WebhookAttempt.delivery_id.in_(deliveries)))
    session.execute(delete(WebhookDelivery).where(WebhookDelivery.endpoint_id == row.id))
    session.delete(row)


def list_deliveries(
    session: Session,
    *,
    endpoint: WebhookEndpoint,
    after: str | None,
    limit: int,
    status: DeliveryStatus | None,
) -> tuple[list[tuple[WebhookDelivery, list[WebhookAttempt]]], bool]:
    """Newest first, each with its attempts in order."""
    stmt = select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint.id)
    if status is not None:
        stmt = stmt.where(WebhookDelivery.status == status)
    rows, has_more = page(session, stmt, WebhookDelivery.id, after=after, limit=limit)
    attempts: dict[str, list[WebhookAttempt]] = {r.id: [] for r in rows}
    if rows:
        for attempt in session.scalars(
            select(WebhookAttempt)
            .where(WebhookAttempt.delivery_id.in_(list(attempts)))
            .order_by(WebhookAttempt.delivery_id, WebhookAttempt.attempt, WebhookAttempt.id)
        ):
            attempts[attempt.delivery_id].append(attempt)
    return [(r, attempts[r.id]) for r in rows], has_more
