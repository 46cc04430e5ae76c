"""The way between the API and the Tinker hosts (worker/tinker_host.py): Redis lists, one request id
per call, no Celery message per call (a call is a few milliseconds of compute on a small model).

- Each host has its own request list (`requests:<host>`); a training client's calls all go to the host
  that holds its adapter, pushed in the order the API received them, and a host runs its list in order,
  so one client's calls run in order. The host moves a request to `taken:<host>` while running it
  (BLMOVE), so that what a host was doing when it died is known.
- A result is a hash `result:<request id>` (`kind` json | proto | error, `body`), then a token on
  `done:<request id>` that a waiting `retrieve_future` BLPOPs: the answer reaches the client as soon as
  it exists, without polling.
- A host is alive while its key `host:<host>` exists: it refreshes it every HEARTBEAT_SECONDS with a
  HOST_TTL_SECONDS expiry. A request whose host is gone, and that has no result, has failed.

Keys are under `tunehouse:tinker:` and expire (results after RESULT_TTL_SECONDS).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, cast

from redis.typing import EncodableT, FieldT

PREFIX = "tunehouse:tinker:"
HEARTBEAT_SECONDS = 1.0
HOST_TTL_SECONDS = 5  # a host that misses this many heartbeats' worth is dead
RESULT_TTL_SECONDS = 3600
REQUEST_TTL_SECONDS = 86400

ResultKind = Literal["json", "proto", "error"]


HOSTS = f"{PREFIX}hosts"  # set of the host ids that ever announced themselves


def key(kind: str, name: str) -> str:
    """The Redis key of one object: `host`, `requests`, `taken` (of a host); `request` (a call's host and
    tenant), `result`, `done` (of a call); `session`, `model` (a training run), `models` (a tenant's
    runs), `host_models`, `checkpoints` (a run's listing), `sampling` (a sampling session)."""
    return f"{PREFIX}{kind}:{name}"


@dataclass(frozen=True)
class Call:
    """One call, as it travels to a host: JSON-safe."""

    request_id: str
    op: str
    tenant_id: str
    args: dict[str, Any]

    def encode(self) -> str:
        return json.dumps(
            {"request_id": self.request_id, "op": self.op, "tenant_id": self.tenant_id, "args": self.args}
        )

    @classmethod
    def decode(cls, raw: bytes | str) -> Call:
        data = json.loads(raw)
        return cls(
            request_id=data["request_id"], op=data["op"], tenant_id=data["tenant_id"], args=data["args"]
        )


@dataclass(frozen=True)
class Result:
    kind: ResultKind
    body: bytes
    category: str = "user"  # an error's: "user" (the call's fault) or "server"

    def mapping(self) -> dict[FieldT, EncodableT]:
        return {"kind": self.kind, "body": self.body, "category": self.category}

    @classmethod
    def from_mapping(cls, data: dict[Any, Any]) -> Result:
        """From the hash as redis-py reads it (bytes keys and values)."""
        kind = data[b"kind"].decode()
        if kind not in ("json", "proto", "error"):
            raise ValueError(f"unknown result kind {kind!r}")
        return cls(
            kind=cast(ResultKind, kind),
            body=bytes(data[b"body"]),
            category=data.get(b"category", b"user").decode(),
        )

    @classmethod
    def json(cls, value: dict[str, Any]) -> Result:
        return cls("json", json.dumps(value).encode())

    @classmethod
    def error(cls, message: str, category: str = "user") -> Result:
        return cls("error", message.encode(), category)
