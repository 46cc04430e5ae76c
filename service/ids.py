"""Public object ids in OpenAI's style (`file-...`, `ftjob-...`).

Ids are time-ordered (milliseconds, then randomness), so ordering by id is ordering by creation and
cursor pagination (`after=<id>`) needs no extra column.
"""

from __future__ import annotations

import secrets
import time


def new_id(prefix: str) -> str:
    millis = int(time.time() * 1000)
    return f"{prefix}-{millis:012x}{secrets.token_hex(6)}"


def now() -> int:
    """Unix seconds, as OpenAI's objects carry them."""
    return int(time.time())
