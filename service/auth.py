"""Bearer API keys. A key is `th-<lookup>-<secret>`: the lookup part finds the row, the sha256 of the
whole key is compared in constant time, and only the hash is stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Annotated

from fastapi import Depends, Header
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.dependencies import SessionDep
from service.errors import Unauthorized
from service.ids import new_id
from service.models import ApiKey, Tenant


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_api_key(session: Session, *, tenant_name: str, key_name: str = "") -> tuple[Tenant, str]:
    """Create the tenant if needed and a new key for it; returns the key in clear, once."""
    tenant = session.scalar(select(Tenant).where(Tenant.name == tenant_name))
    if tenant is None:
        tenant = Tenant(id=new_id("tenant"), name=tenant_name)
        session.add(tenant)
        session.flush()
    lookup = secrets.token_hex(8)
    key = f"th-{lookup}-{secrets.token_urlsafe(32)}"
    session.add(
        ApiKey(id=new_id("key"), tenant_id=tenant.id, lookup=lookup, key_hash=_hash(key), name=key_name)
    )
    session.flush()
    return tenant, key


def tenant_for_key(session: Session, key: str) -> Tenant | None:
    parts = key.split("-", 2)
    if len(parts) != 3 or parts[0] != "th":
        return None
    row = session.scalar(select(ApiKey).where(ApiKey.lookup == parts[1], ApiKey.revoked_at.is_(None)))
    if row is None or not hmac.compare_digest(row.key_hash, _hash(key)):
        return None
    return session.get(Tenant, row.tenant_id)


def _current_tenant(session: SessionDep, authorization: Annotated[str | None, Header()] = None) -> Tenant:
    if not authorization or not authorization.lower().startswith("bearer "):
        raise Unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
            "(create one with `tunehouse keys create --tenant NAME`).",
            code="missing_api_key",
        )
    tenant = tenant_for_key(session, authorization[7:].strip())
    if tenant is None:
        raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
    return tenant


TenantDep = Annotated[Tenant, Depends(_current_tenant)]
