"""The API-key cache (service/key_cache.py) against the real database: a hit reads no row, yet a key
revoked in this process is refused at once, one revoked elsewhere within the TTL, an expired one at
its expiry, and a wrong secret never matches a cached key. The cache's clock is moved by hand."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import event, update

from service import key_cache
from service.auth import authenticate, create_api_key, revoke_api_key
from service.config import get_settings
from service.db import get_engine, session_scope
from service.errors import Unauthorized
from service.ids import now
from service.models import ApiKey
from tests.conftest import new_key

TTL = get_settings().auth_cache_seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The cache's monotonic clock, set by the test."""
    key_cache.clear()
    t = [1000.0]
    monkeypatch.setattr(key_cache, "_clock", lambda: t[0])
    yield t
    key_cache.clear()


@pytest.fixture
def queries() -> Iterator[list[str]]:
    seen: list[str] = []

    def record(*args: object) -> None:
        seen.append(str(args[2]))  # (conn, cursor, statement, ...)

    event.listen(get_engine(), "before_cursor_execute", record)
    yield seen
    event.remove(get_engine(), "before_cursor_execute", record)


def _auth(key: str) -> str:
    with session_scope() as session:
        return authenticate(session, key).id


def _revoke_elsewhere(key: str) -> None:
    """What `tunehouse keys revoke` in another process does: the row changes, this cache is not told."""
    with session_scope() as session:
        session.execute(update(ApiKey).where(ApiKey.lookup == key.split("-")[1]).values(revoked_at=now()))


def test_a_cached_key_reads_no_row(clock: list[float], queries: list[str]) -> None:
    key = new_key()
    tenant_id = _auth(key)
    assert any("api_keys" in q for q in queries)
    queries.clear()
    assert _auth(key) == tenant_id
    assert not any("api_keys" in q or "tenants" in q for q in queries), queries


def test_revoked_in_this_process_is_refused_at_once(clock: list[float]) -> None:
    key = new_key()
    _auth(key)
    with session_scope() as session:
        revoke_api_key(session, key=key.rsplit("-", 1)[0])  # by its public prefix
    with pytest.raises(Unauthorized, match="revoked"):
        _auth(key)


def test_revoked_elsewhere_is_refused_once_the_ttl_has_passed(clock: list[float]) -> None:
    key = new_key()
    _auth(key)
    _revoke_elsewhere(key)
    clock[0] += TTL * 0.9
    _auth(key)  # still cached: the documented window
    clock[0] += TTL * 0.2
    with pytest.raises(Unauthorized, match="revoked"):
        _auth(key)


def test_an_expired_key_is_refused_from_its_expiry_even_when_cached(
    clock: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    with session_scope() as session:
        _, key = create_api_key(session, tenant_name=f"brief-{now()}", expires_in_seconds=60)
    _auth(key)
    later = now() + 61
    monkeypatch.setattr(key_cache, "now", lambda: later)
    with pytest.raises(Unauthorized) as refused:
        _auth(key)
    assert refused.value.code == "expired_api_key"


def test_a_wrong_secret_never_matches_a_cached_key(clock: list[float]) -> None:
    key = new_key()
    _auth(key)
    with pytest.raises(Unauthorized):
        _auth(key[:-2] + ("xx" if not key.endswith("xx") else "yy"))


def test_the_cache_can_be_disabled(clock: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNEHOUSE_AUTH_CACHE_SECONDS", "0")
    get_settings.cache_clear()
    try:
        key = new_key()
        _auth(key)
        _revoke_elsewhere(key)
        with pytest.raises(Unauthorized, match="revoked"):
            _auth(key)
    finally:
        get_settings.cache_clear()
