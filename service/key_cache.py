"""A short-lived, per-process cache of API key -> tenant, so a request with a known key reads no
database row before its own work (the lookup used to be a query and a threadpool hop per request).

What stays true with the cache (TTL = `auth_cache_seconds`, 5 s by default):
- a revoked key is refused by every API process within the TTL; one revoked through this process
  (`service.auth.revoke_api_key`) is dropped from this cache at once;
- an expired key is refused from the second it expires (the expiry is cached and checked on each hit);
- only keys that authenticated are cached, under their public lookup part, with the sha256 of the
  whole key compared in constant time on every hit, so a wrong secret never matches an entry.
The cached tenant is an immutable snapshot; each hit gets its own transient `Tenant` built from it
(never an ORM instance shared between sessions or threads).
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass

from service.config import get_settings
from service.errors import Unauthorized
from service.ids import now
from service.models import Tenant

# Only authenticated keys are cached, so this bounds memory only against an operator's own key count;
# past it the cache starts over rather than growing.
MAX_ENTRIES = 10_000


@dataclass(frozen=True)
class _Entry:
    key_hash: str
    key_expires_at: int | None
    tenant_id: str
    tenant_name: str
    tenant_created_at: int
    cached_until: float


_entries: dict[str, _Entry] = {}


def _clock() -> float:
    return time.monotonic()


def get(lookup: str, key_hash: str) -> Tenant | None:
    """The tenant of a cached key; None when not cached (or stale); Unauthorized if it has expired."""
    entry = _entries.get(lookup)
    if entry is None or entry.cached_until <= _clock() or not hmac.compare_digest(entry.key_hash, key_hash):
        return None
    if entry.key_expires_at is not None and entry.key_expires_at <= now():
        _entries.pop(lookup, None)
        raise Unauthorized("This API key has expired.", code="expired_api_key")
    return Tenant(id=entry.tenant_id, name=entry.tenant_name, created_at=entry.tenant_created_at)


def put(lookup: str, key_hash: str, key_expires_at: int | None, tenant: Tenant) -> None:
    ttl = get_settings().auth_cache_seconds
    if ttl <= 0:
        return
    if len(_entries) >= MAX_ENTRIES:
        _entries.clear()
    _entries[lookup] = _Entry(
        key_hash=key_hash,
        key_expires_at=key_expires_at,
        tenant_id=tenant.id,
        tenant_name=tenant.name,
        tenant_created_at=tenant.created_at,
        cached_until=_clock() + ttl,
    )


def forget(lookup: str) -> None:
    _entries.pop(lookup, None)


def clear() -> None:
    _entries.clear()
