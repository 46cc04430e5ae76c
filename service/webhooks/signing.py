"""Standard Webhooks signatures (https://www.standardwebhooks.com, the spec OpenAI's webhooks follow).

A secret is `whsec_` + base64 of 32 random bytes; the key is the decoded bytes. Each request carries
`webhook-id`, `webhook-timestamp` (unix seconds) and `webhook-signature: v1,<base64 HMAC-SHA256 of
"{id}.{timestamp}.{body}">`. `verify` is what a receiver runs (the tests run it, and the reference
library `standardwebhooks` as well).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

SECRET_PREFIX = "whsec_"
# a receiver should refuse a timestamp further than this from its clock (replay protection)
TOLERANCE_SECONDS = 5 * 60


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def _key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX))


def sign(secret: str, *, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header value."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def headers(secret: str, *, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, msg_id=msg_id, timestamp=timestamp, body=body),
        "content-type": "application/json",
    }


def verify(secret: str, *, headers: dict[str, str], body: bytes, now: float) -> bool:
    """True if one of the space-separated `v1,` signatures matches and the timestamp is fresh."""
    try:
        msg_id, timestamp = headers["webhook-id"], int(headers["webhook-timestamp"])
    except (KeyError, ValueError):
        return False
    if abs(now - timestamp) > TOLERANCE_SECONDS:
        return False
    expected = sign(secret, msg_id=msg_id, timestamp=timestamp, body=body)
    return any(hmac.compare_digest(expected, s) for s in headers.get("webhook-signature", "").split())
