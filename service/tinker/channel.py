"""The way between the API and the Tinker hosts (worker/tinker_host.py): Redis lists, one request id
per call, no Celery message per call (a call is a few milliseconds of compute on a small model).

- Each host has its own queues: one per client (a training run or a sampling session) of each tenant
  (`queue:<host>:<tenant>:<client>`), a ring of each tenant's clients with calls waiting, and a ring of
  the tenants with calls waiting (`ring:<host>`). The host takes the next call round-robin: the next
  tenant of the ring, that tenant's next client, that client's oldest call (TAKE below), so one tenant's
  flood waits behind the others' calls instead of before them, and one client's calls still run in the
  order the API received them. A tenant may have at most `tinker_max_queued_calls` calls waiting on a
  host (PUSH answers -1 past that: the API's 429). The host moves the call it runs to `taken:<host>`,
  so that what a host was doing when it died is known; `wake:<host>` wakes an idle host at once.
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

# KEYS: ring, the tenant's client ring, the client's queue, the tenant's waiting count, wake;
# ARGV: the call, tenant, client, cap. The call's position in its queue, or -1 when the tenant is full.
PUSH = """
local waiting = tonumber(redis.call('GET', KEYS[4]) or '0')
if waiting >= tonumber(ARGV[4]) then return -1 end
redis.call('INCR', KEYS[4])
if redis.call('RPUSH', KEYS[3], ARGV[1]) == 1 then
  if redis.call('RPUSH', KEYS[2], ARGV[3]) == 1 then redis.call('RPUSH', KEYS[1], ARGV[2]) end
end
redis.call('LPUSH', KEYS[5], '1')
redis.call('LTRIM', KEYS[5], 0, 0)
return waiting + 1
"""
# KEYS: ring, taken; ARGV: the key prefix, host. The next call round-robin (tenants, then their
# clients), moved to `taken`; nil when nothing waits.
TAKE = """
local tenant = redis.call('LPOP', KEYS[1])
if not tenant then return false end
local base = ARGV[2] .. ':' .. tenant
local clients = ARGV[1] .. 'clients:' .. base
local client = redis.call('LPOP', clients)
if not client then return false end
local queue = ARGV[1] .. 'queue:' .. base .. ':' .. client
local call = redis.call('LPOP', queue)
redis.call('DECR', ARGV[1] .. 'waiting:' .. base)
if redis.call('LLEN', queue) > 0 then redis.call('RPUSH', clients, client) end
if redis.call('LLEN', clients) > 0 then redis.call('RPUSH', KEYS[1], tenant) end
if not call then return false end
redis.call('RPUSH', KEYS[2], call)
return call
"""


def queue_keys(host: str, tenant_id: str, client: str) -> list[str]:
    """PUSH's keys for one call of `client` (a training run or sampling session) of `tenant_id`."""
    base = f"{host}:{tenant_id}"
    return [
        key("ring", host),
        key("clients", base),
        key("queue", f"{base}:{client}"),
        key("waiting", base),
        key("wake", host),
    ]


HOSTS = f"{PREFIX}hosts"  # set of the host ids that ever announced themselves


def key(kind: str, name: str) -> str:
    """The Redis key of one object: `host`, `ring`, `wake`, `taken` (of a host); `clients`, `waiting` (of
    a tenant on a host), `queue` (of a client on a host); `request` (a call's host and tenant), `result`,
    `done` (of a call); `session`, `session_samplers`, `model` (a training run's live part), `models` (a
    tenant's runs), `host_models`, `sampling` (a sampling session), `sequence` (a recorded sample),
    `context` (a base model's context length, as a host loaded it)."""
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
