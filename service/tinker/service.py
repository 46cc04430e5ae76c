"""The rules of the Tinker API on the API side: sessions, training runs (adapters), sampling sessions,
calls sent to the host that holds the adapter, futures read back. No torch: the work runs on a Tinker
host (worker/tinker_host.py); the way there and back is service/tinker/channel.py.

What survives what: sessions and training runs are durable in PostgreSQL (service/tinker/runs.py), their
checkpoints' metadata too (service/base_models/tinker_checkpoints.py) and their files in the blob store;
Redis holds what is transient: the live part of sessions and runs (which host, counters), sampling
sessions, recorded samples, queued calls and results. A host that dies loses its adapters' state since
their last `save_state`: calls it had taken or queued fail (`retrieve_future` answers the SDK's failed-request
shape, category `server`), and a later call of one of its clients answers 410 `tinker_client_lost`
naming the way back (`create_training_client_from_state` with the last saved path).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from service.base_models.tinker_checkpoints import TINKER_PATH_PREFIX
from service.errors import AppError, BadRequest, Conflict, NotFound, ServiceUnavailable
from service.ids import new_id
from service.tinker import channel
from service.tinker.channel import Call, Result, key

SESSION_TTL_SECONDS = 7 * 86400
WAIT_SECONDS = 10.0  # one retrieve_future waits this long for a result before answering try_again
# a sequence sampled with record_stability_info can be trained on for a day after it was sampled or last
# trained on (Tinker's rule)
RECORD_TTL_SECONDS = 86400


class QueueFull(AppError):
    """429 with Retry-After: the tenant has as many calls waiting on this worker as it may."""

    status_code = 429
    type = "rate_limit_error"

    def __init__(self, cap: int) -> None:
        super().__init__(
            f"Too many Tinker calls waiting: at most {cap} per organization on a worker; wait for results "
            "(retrieve_future) before sending more.",
            code="tinker_queue_full",
        )

    def headers(self) -> dict[str, str] | None:
        return {"retry-after": "1"}


class ClientLost(AppError):
    """410: the SDK retries 409 and 5xx on its own, and this one will not get better by retrying."""

    status_code = 410
    type = "invalid_request_error"

    def __init__(self, model_id: str) -> None:
        super().__init__(
            f"The training client '{model_id}' was lost: the worker that held it stopped, and its state "
            "since the last save_state with it. Create a new client from your last saved state "
            "(ServiceClient.create_training_client_from_state(path)).",
            param="model_id",
            code="tinker_client_lost",
        )


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: str  # weights | sampler_weights
    name: str

    @classmethod
    def parse(cls, path: str, *, param: str) -> TinkerPath:
        parts = (
            path.removeprefix(TINKER_PATH_PREFIX).split("/") if path.startswith(TINKER_PATH_PREFIX) else []
        )
        if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not parts[2]:
            raise BadRequest(
                f"{param}: '{path}' is not a tinker path (tinker://<run>/weights/<name> or "
                "tinker://<run>/sampler_weights/<name>)",
                param=param,
            )
        return cls(*parts)


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _strs(raw: dict[Any, Any]) -> dict[str, str]:
    """A Redis hash as text (redis-py answers bytes; its types allow str too)."""
    return {_str(k): _str(v) for k, v in raw.items()}


class Tinker:
    """One per API process: the Redis connection and the calls."""

    def __init__(self, redis_url: str, max_queued: int = 256) -> None:
        self.max_queued = max_queued
        if not redis_url:
            raise ServiceUnavailable(
                "The Tinker API needs Redis (set TUNEHOUSE_REDIS_URL); the embedded default has none.",
                code="tinker_unavailable",
            )
        self.redis = Redis.from_url(redis_url, socket_connect_timeout=1.0, socket_timeout=None)
        self._push = self.redis.register_script(channel.PUSH)

    # --- sessions ---------------------------------------------------------------------------------------

    async def create_session(self, tenant_id: str, metadata: dict[str, Any]) -> str:
        session_id = new_id("tsession")
        session_key = key("session", session_id)
        await self.redis.hset(
            session_key,
            mapping={
                "tenant_id": tenant_id,
                "created": time.time(),
                "heartbeat": time.time(),
                "metadata": json.dumps(metadata),
            },
        )
        await self.redis.expire(session_key, SESSION_TTL_SECONDS)
        return session_id

    async def restore_session(self, tenant_id: str, session_id: str, metadata: dict[str, Any]) -> None:
        """A session PostgreSQL knows and Redis lost (a restart) is live again."""
        session_key = key("session", session_id)
        mapping: dict[FieldT, EncodableT] = {
            "tenant_id": tenant_id,
            "created": time.time(),
            "heartbeat": time.time(),
            "metadata": json.dumps(metadata),
        }
        await self.redis.hset(session_key, mapping=mapping)
        await self.redis.expire(session_key, SESSION_TTL_SECONDS)

    async def session_samplers(self, session_id: str) -> list[str]:
        return sorted(_str(s) for s in await self.redis.smembers(key("session_samplers", session_id)))

    async def heartbeat(self, tenant_id: str, session_id: str) -> None:
        await self._session(tenant_id, session_id)
        session_key = key("session", session_id)
        await self.redis.hset(session_key, "heartbeat", time.time())
        await self.redis.expire(session_key, SESSION_TTL_SECONDS)

    async def _session(self, tenant_id: str, session_id: str) -> None:
        owner = await self.redis.hget(key("session", session_id), "tenant_id")
        if owner is None or _str(owner) != tenant_id:
            raise NotFound(f"No session '{session_id}'", param="session_id", code="session_not_found")

    # --- hosts ------------------------------------------------------------------------------------------

    async def _alive(self, host: str) -> bool:
        return bool(await self.redis.exists(channel.key("host", host)))

    async def pick_host(self) -> str:
        """The live host with the fewest training clients: new adapters spread over the hosts."""
        hosts = [_str(h) for h in await self.redis.smembers(channel.HOSTS)]
        alive = [h for h in hosts if await self._alive(h)]
        if not alive:
            raise ServiceUnavailable(
                "No Tinker worker is running (start one: `tunehouse worker --tinker`).",
                code="tinker_no_worker",
            )
        counts = [await self.redis.scard(key("host_models", h)) for h in alive]
        return min(zip(counts, alive, strict=True))[1]

    # --- training runs ----------------------------------------------------------------------------------

    async def model(self, tenant_id: str, model_id: str, *, param: str = "model_id") -> dict[str, str]:
        """A training run of this tenant (404 otherwise, another tenant's included)."""
        run = _strs(await self.redis.hgetall(key("model", model_id)))
        if run.get("tenant_id") != tenant_id:
            raise NotFound(f"No training run '{model_id}'", param=param, code="model_not_found")
        return run | {"id": model_id}

    async def register_model(
        self,
        tenant_id: str,
        *,
        session_id: str,
        model_seq_id: int,
        base_model: str,
        spec: dict[str, Any],
        metadata: dict[str, Any],
    ) -> tuple[str, str]:
        """A new training run's id and the host chosen for it (its create call not yet sent). The id is
        `<session>:train:<seq>`, as the SDK derives it itself when it creates a client from a state."""
        await self._session(tenant_id, session_id)
        host = await self.pick_host()
        model_id = f"{session_id}:train:{model_seq_id}"
        created = await self.redis.hsetnx(key("model", model_id), "tenant_id", tenant_id)
        if not created:
            raise Conflict(
                f"model_seq_id: client {model_seq_id} of this session exists", param="model_seq_id"
            )
        await self.redis.hset(
            key("model", model_id),
            mapping={
                "tenant_id": tenant_id,
                "session_id": session_id,
                "base_model": base_model,
                "spec": json.dumps(spec),
                "metadata": json.dumps(metadata),
                "host": host,
                "created": time.time(),
                "last_request": time.time(),
                "calls": 0,
            },
        )
        await self.redis.sadd(key("host_models", host), model_id)
        return model_id, host

    async def host_of(self, tenant_id: str, model_id: str) -> str:
        """The live host holding this client's adapter; ClientLost when that host is gone."""
        run = await self.model(tenant_id, model_id)
        if not await self._alive(run["host"]):
            raise ClientLost(model_id)
        return run["host"]

    # --- calls ------------------------------------------------------------------------------------------

    @staticmethod
    def new_request_id() -> str:
        return f"treq-{secrets.token_hex(12)}"

    async def send(
        self,
        host: str,
        op: str,
        tenant_id: str,
        args: dict[str, Any],
        *,
        model_id: str | None = None,
        client: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue one call on `host` in the queue of its client (`model_id`, or `client` for a sampling
        session); its request id, for `retrieve_future`. QueueFull when the tenant has too many waiting."""
        request_id = request_id or self.new_request_id()
        call = Call(request_id=request_id, op=op, tenant_id=tenant_id, args=args)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(channel.key("request", request_id), mapping={"host": host, "tenant_id": tenant_id})
            pipe.expire(channel.key("request", request_id), channel.REQUEST_TTL_SECONDS)
            await pipe.execute()
        keys = channel.queue_keys(host, tenant_id, model_id or client or "-")
        if (
            await self._push(
                keys=keys, args=[call.encode(), tenant_id, model_id or client or "-", self.max_queued]
            )
            == -1
        ):
            await self.redis.delete(channel.key("request", request_id))
            raise QueueFull(self.max_queued)
        if model_id is not None:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(key("model", model_id), "last_request", time.time())
                pipe.hincrby(key("model", model_id), "calls", 1)
                await pipe.execute()
        return request_id

    async def counters(self, model_id: str) -> dict[str, str]:
        """A run's live counters (calls, steps, last_loss, last_request); none after Redis lost them."""
        found = _strs(await self.redis.hgetall(key("model", model_id)))
        return {k: v for k, v in found.items() if k in ("calls", "steps", "last_loss", "last_request")}

    async def context_of(self, base_model: str) -> int | None:
        """The context length of `base_model` as a host loaded it; None before any host did."""
        found = await self.redis.get(key("context", base_model))
        return None if found is None else int(found)

    async def retrieve(self, tenant_id: str, request_id: str) -> Result | None:
        """The call's result, waiting up to WAIT_SECONDS; None: not done yet (the SDK asks again).
        The owner and the result are read in one round trip: a call already done costs one."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(channel.key("request", request_id))
            pipe.hgetall(channel.key("result", request_id))
            owner_raw, found = await pipe.execute()
        owner = _strs(owner_raw)
        if owner.get("tenant_id") != tenant_id:
            raise NotFound(f"No request '{request_id}'", param="request_id", code="request_not_found")
        deadline = time.monotonic() + WAIT_SECONDS
        while not found:
            if not await self._alive(owner["host"]):
                return Result.error(
                    "The Tinker worker running this call stopped before it finished; the training "
                    "client's state since its last save_state is lost.",
                    "server",
                )
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            # the host stores the result, then pushes a token here; wake at least each second to
            # check that the host is still alive
            await self.redis.blpop([channel.key("done", request_id)], timeout=min(left, 1.0))
            found = await self.redis.hgetall(channel.key("result", request_id))
        return Result.from_mapping(found)

    # --- sampling sessions ------------------------------------------------------------------------------

    async def create_sampling_session(
        self,
        tenant_id: str,
        *,
        session_id: str,
        base_model: str | None,
        model_path: str | None,
        host: str | None = None,
    ) -> str:
        await self._session(tenant_id, session_id)
        mapping: dict[FieldT, EncodableT] = {"tenant_id": tenant_id, "session_id": session_id}
        if model_path is not None:
            path = TinkerPath.parse(model_path, param="model_path")
            run = await self.model(tenant_id, path.model_id, param="model_path")
            mapping |= {"model_path": model_path, "base_model": run["base_model"], "model_id": path.model_id}
        elif base_model is not None:
            mapping["base_model"] = base_model
        else:
            raise BadRequest("model_path or base_model: one is required", param="model_path")
        mapping["host"] = host or await self.pick_host()
        sampling_session_id = new_id("tsampler")
        await self.redis.hset(key("sampling", sampling_session_id), mapping=mapping)
        await self.redis.expire(key("sampling", sampling_session_id), SESSION_TTL_SECONDS)
        await self.redis.sadd(key("session_samplers", session_id), sampling_session_id)
        await self.redis.expire(key("session_samplers", session_id), SESSION_TTL_SECONDS)
        return sampling_session_id

    # --- recorded samples (stable_reinforce) ------------------------------------------------------------

    async def recorded(self, tenant_id: str, session_id: str, ids: set[str]) -> dict[str, dict[str, Any]]:
        """The sequences of `ids` that this session sampled with record_stability_info, by id; each one
        read is kept another RECORD_TTL_SECONDS. Another session's (or tenant's) is absent."""
        found: dict[str, dict[str, Any]] = {}
        for sequence_id in ids:
            record = _strs(await self.redis.hgetall(key("sequence", sequence_id)))
            if record.get("tenant_id") != tenant_id or record.get("session_id") != session_id:
                continue
            await self.redis.expire(key("sequence", sequence_id), RECORD_TTL_SECONDS)
            found[sequence_id] = {name: json.loads(record[name]) for name in ("prompt", "tokens", "logprobs")}
        return found

    async def sampling_session(self, tenant_id: str, sampling_session_id: str) -> dict[str, str]:
        session = _strs(await self.redis.hgetall(key("sampling", sampling_session_id)))
        if session.get("tenant_id") != tenant_id:
            raise NotFound(
                f"No sampling session '{sampling_session_id}'", param="sampling_session_id", code="not_found"
            )
        if not await self._alive(session["host"]):  # sampling holds no state: any live host will do
            session["host"] = await self.pick_host()
            await self.redis.hset(key("sampling", sampling_session_id), "host", session["host"])
        return session


async def guard(call: Any) -> Any:
    """Await a Redis call; a Redis that is down is a 503 with Retry-After."""
    try:
        return await call
    except AppError:
        raise
    except (RedisError, OSError) as exc:
        raise ServiceUnavailable(
            f"Redis is unavailable ({type(exc).__name__})", code="redis_unavailable"
        ) from exc
