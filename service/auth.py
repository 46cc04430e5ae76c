"""Bearer API keys. A key is `th-<lookup>-<secret>`: the lookup part finds the row, the sha256 of the
whole key is compared in constant time, and only the hash is stored.

A key that authenticated is cached by each API process for `auth_cache_seconds` (5 s by default;
service/key_cache.py): a key revoked with `tunehouse keys revoke` is refused by every running server
within that time (at once by a process that revoked it itself), an expired one from the second it
expires. A stream opened with a key (service/jobs/stream.py) asks `KeyWatch` as it goes and ends
within the same bound once its key is revoked, and once it expires.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from service import key_cache
from service.db import DB_UNAVAILABLE_ERRORS
from service.db_reads import CompiledRead, ReadRow
from service.dependencies import read_row
from service.errors import NotFound, ServiceUnavailable, Unauthorized
from service.ids import new_id, now
from service.models import ApiKey, Tenant

KEY_PREFIX = "th"
log = logging.getLogger("tunehouse.api")
# the database is down, or busy past the wait for a slot: a stream's key is read again next time
_DB_NOT_NOW: tuple[type[Exception], ...] = (*DB_UNAVAILABLE_ERRORS, ServiceUnavailable)


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_api_key(
    session: Session, *, tenant_name: str, key_name: str = "", expires_in_seconds: int | None = None
) -> tuple[Tenant, str]:
    """Create the tenant if needed and a new key for it; returns the key in clear, once."""
    tenant = session.scalar(select(Tenant).where(Tenant.name == tenant_name))
    if tenant is None:
        tenant = Tenant(id=new_id("tenant"), name=tenant_name)
        session.add(tenant)
        session.flush()
    lookup = secrets.token_hex(8)
    key = f"{KEY_PREFIX}-{lookup}-{secrets.token_urlsafe(32)}"
    session.add(
        ApiKey(
            id=new_id("key"),
            tenant_id=tenant.id,
            lookup=lookup,
            key_hash=_hash(key),
            name=key_name,
            expires_at=now() + expires_in_seconds if expires_in_seconds is not None else None,
        )
    )
    session.flush()
    return tenant, key


def _lookup_part(key: str) -> str | None:
    parts = key.split("-", 2)
    return parts[1] if len(parts) >= 2 and parts[0] == KEY_PREFIX and parts[1] else None


# A key's row and its tenant's in one statement, for the API's event loop (service/db_reads.py) and
# for sessions alike; no row when the key is unknown or its tenant was deleted under it. Bound at
# execution: `lookup`.
_KEY_READ = CompiledRead(
    select(
        ApiKey.key_hash,
        ApiKey.revoked_at,
        ApiKey.expires_at,
        Tenant.id.label("tenant_id"),
        Tenant.name.label("tenant_name"),
        Tenant.created_at.label("tenant_created_at"),
    )
    .join(Tenant, Tenant.id == ApiKey.tenant_id)
    .where(ApiKey.lookup == bindparam("lookup"))
)


def _tenant_of(row: ReadRow | None, *, lookup: str | None, key_hash: str) -> Tenant:
    """The tenant of a key whose row (`_KEY_READ`) is `row`, cached for the next request; Unauthorized
    saying why otherwise (only once the secret matched)."""
    if lookup is None or row is None or not hmac.compare_digest(row.key_hash, key_hash):
        raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
    if row.revoked_at is not None:
        raise Unauthorized("This API key has been revoked.", code="invalid_api_key")
    if row.expires_at is not None and row.expires_at <= now():
        raise Unauthorized("This API key has expired.", code="expired_api_key")
    # not attached to any session: a request reads its id and name, it never writes it
    tenant = Tenant(id=row.tenant_id, name=row.tenant_name, created_at=row.tenant_created_at)
    key_cache.put(lookup, key_hash, row.expires_at, tenant)
    return tenant


def authenticate(session: Session, key: str) -> Tenant:
    """The tenant of a valid key; Unauthorized saying why otherwise (only once the secret matched)."""
    lookup = _lookup_part(key)
    key_hash = _hash(key)
    cached = key_cache.get(lookup, key_hash) if lookup else None
    if cached is not None:
        return cached
    row = session.execute(_KEY_READ.statement, {"lookup": lookup}).first() if lookup else None
    return _tenant_of(row, lookup=lookup, key_hash=key_hash)


def tenant_for_key(session: Session, key: str) -> Tenant | None:
    try:
        return authenticate(session, key)
    except Unauthorized:
        return None


@dataclass(frozen=True)
class KeyInfo:
    """What an operator may see of a key: never the secret, nor its hash."""

    id: str
    tenant: str
    tenant_id: str
    name: str
    prefix: str  # `th-<lookup>`, the public start of the key
    created_at: int
    expires_at: int | None
    revoked_at: int | None

    @property
    def status(self) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now():
            return "expired"
        return "active"


def list_api_keys(session: Session, *, tenant_name: str | None = None) -> list[KeyInfo]:
    stmt = select(ApiKey, Tenant).join(Tenant, Tenant.id == ApiKey.tenant_id).order_by(ApiKey.id)
    if tenant_name is not None:
        stmt = stmt.where(Tenant.name == tenant_name)
    return [
        KeyInfo(
            id=key.id,
            tenant=tenant.name,
            tenant_id=tenant.id,
            name=key.name,
            prefix=f"{KEY_PREFIX}-{key.lookup}",
            created_at=key.created_at,
            expires_at=key.expires_at,
            revoked_at=key.revoked_at,
        )
        for key, tenant in session.execute(stmt)
    ]


def revoke_api_key(session: Session, *, key: str) -> ApiKey:
    """Revoke by key id (`key-...`), by the key's public prefix (`th-<lookup>`) or by the key itself."""
    lookup = _lookup_part(key)
    stmt = select(ApiKey).where(ApiKey.lookup == lookup) if lookup else select(ApiKey).where(ApiKey.id == key)
    row = session.scalar(stmt)
    if row is None:
        raise NotFound(f"no API key '{key}' (give its id, key-..., or its prefix, th-...)", param="key")
    if row.revoked_at is None:
        row.revoked_at = now()
        session.flush()
    key_cache.forget(row.lookup)  # this process refuses it at once; others within the cache's TTL
    return row


_bearer = HTTPBearer(
    auto_error=False,
    description="An API key (`tunehouse keys create --tenant NAME`), sent as `Authorization: Bearer <key>`.",
)


async def _current_tenant(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Tenant:
    if credentials is None:
        raise Unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
            "(create one with `tunehouse keys create --tenant NAME`).",
            code="missing_api_key",
        )
    return await tenant_of_key(credentials.credentials.strip())


async def tenant_of_key(key: str) -> Tenant:
    """The tenant of a key given on any route (a Bearer token, or the Tinker SDK's `X-API-Key`)."""
    lookup = _lookup_part(key)
    key_hash = _hash(key)
    if lookup is None:
        return _tenant_of(None, lookup=None, key_hash=key_hash)
    # a cached key costs no thread and no query; otherwise its row is read on the event loop, holding
    # a database slot only while it reads (or the slot its request holds already): a route that needs
    # no request session, like a job's read, opens none
    cached = key_cache.get(lookup, key_hash)
    if cached is not None:
        return cached
    return _tenant_of(await read_row(_KEY_READ, {"lookup": lookup}), lookup=lookup, key_hash=key_hash)


TenantDep = Annotated[Tenant, Depends(_current_tenant)]


async def _current_key(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)], _tenant: TenantDep
) -> str:
    """The request's API key, once `TenantDep` has accepted it (for a long request that must check it
    again as it goes: `KeyWatch`)."""
    assert credentials is not None  # TenantDep refused the request otherwise
    return credentials.credentials.strip()


ApiKeyDep = Annotated[str, Depends(_current_key)]


class KeyWatch:
    """Whether the key a long request (an SSE stream) was opened with is still good.

    A request is authenticated once, when it starts; a stream lasts as long as its job (issue 46: one
    opened before its key was revoked delivered rows until the job ended). `refusal()`, asked on each
    pass of the stream, re-reads the key's row every `recheck_seconds` (skipping the cache, which may
    be that old itself) and checks the expiry it read on every call. A database outage refuses
    nothing: the stream goes on and the next read decides.
    """

    def __init__(self, key: str, *, recheck_seconds: float) -> None:
        self.key, self.recheck_seconds = key, recheck_seconds
        self.lookup, self.key_hash = _lookup_part(key), _hash(key)
        self.expires_at: int | None = None
        self.read_at = -float("inf")  # the first call reads the row: the expiry is not known yet

    async def refusal(self) -> Unauthorized | None:
        """None while the key is valid; the error a new request would get once it is not."""
        if self.expires_at is not None and self.expires_at <= now():
            return Unauthorized("This API key has expired.", code="expired_api_key")
        if time.monotonic() - self.read_at < self.recheck_seconds:
            return None
        # set first: through a database outage the key is tried once an interval, not on every pass
        self.read_at = time.monotonic()
        try:
            row = await read_row(_KEY_READ, {"lookup": self.lookup}) if self.lookup else None
        except _DB_NOT_NOW as exc:
            log.warning("could not re-check a stream's API key (%s); it stays open", type(exc).__name__)
            return None
        try:
            _tenant_of(row, lookup=self.lookup, key_hash=self.key_hash)
        except Unauthorized as exc:
            if self.lookup is not None:  # this process knows now: its next request with it is refused too
                key_cache.forget(self.lookup)
            return exc
        assert row is not None  # _tenant_of refuses a missing row
        self.expires_at = row.expires_at
        return None
