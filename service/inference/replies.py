"""The way back from an inference worker to the API process that waits for one request's answer.

Each request has its own channel, written by one worker and read by one API process, in order:
- a Redis list (`tunehouse:inference:<request id>`, RPUSH by the worker, BLPOP by the API) when
  `TUNEHOUSE_REDIS_URL` is set, so the two may run on different machines; a list, not pub/sub, so a
  message sent before the API is listening is not lost, and it expires if nobody reads it;
- a JSON-lines file under the data dir in the embedded default (`tunehouse up` has no Redis; its
  worker shares the machine and the folder, as it does for the filesystem broker).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any, Protocol

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import RedisError

from service.config import Settings

# an unread answer (the API gave up, or died) is dropped by Redis after this long
EXPIRE_SECONDS = 600
CONNECT_TIMEOUT = 1.0  # a Redis that is down must answer 503 fast, not hang the request
FILE_POLL_SECONDS = 0.02  # the embedded channel's latency: well under a token's time on a CPU

Message = dict[str, Any]


class ReplyChannelDown(Exception):
    """The reply channel (Redis) cannot be reached."""


def _key(request_id: str) -> str:
    return f"tunehouse:inference:{request_id}"


def _file(settings: Settings, request_id: str) -> Path:
    return settings.data_dir / "inference" / f"{request_id}.jsonl"


class ReplyWriter(Protocol):
    def send(self, message: Message) -> None: ...

    def close(self) -> None: ...


class ReplyReader(Protocol):
    async def check(self) -> None: ...

    async def receive(self, timeout: float) -> Message | None: ...

    async def close(self) -> None: ...


class _RedisWriter:
    def __init__(self, url: str, request_id: str) -> None:
        self.redis = Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT)
        self.key = _key(request_id)

    def send(self, message: Message) -> None:
        with self.redis.pipeline() as pipe:
            pipe.rpush(self.key, json.dumps(message))
            pipe.expire(self.key, EXPIRE_SECONDS)
            pipe.execute()

    def close(self) -> None:
        self.redis.close()


class _RedisReader:
    def __init__(self, url: str, request_id: str) -> None:
        # no read timeout: BLPOP blocks up to its own timeout (a dropped connection still raises)
        self.redis = AsyncRedis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=None)
        self.key = _key(request_id)

    async def check(self) -> None:
        try:
            await self.redis.ping()
        except (RedisError, OSError) as exc:
            raise ReplyChannelDown(str(exc)) from exc

    async def receive(self, timeout: float) -> Message | None:
        try:
            popped = await self.redis.blpop([self.key], timeout=timeout)
        except (RedisError, OSError) as exc:
            raise ReplyChannelDown(str(exc)) from exc
        return None if popped is None else dict(json.loads(popped[1]))

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):  # it expires on its own
            await self.redis.delete(self.key)
        await self.redis.aclose()


class _FileWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = path.open("a", encoding="utf-8")

    def send(self, message: Message) -> None:
        self.fh.write(json.dumps(message) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


class _FileReader:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.pending = b""

    async def check(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

    async def receive(self, timeout: float) -> Message | None:
        deadline = time.monotonic() + timeout
        while True:
            line, sep, rest = self.pending.partition(b"\n")
            if sep:
                self.pending = rest
                return dict(json.loads(line))
            if self.path.exists():
                with self.path.open("rb") as fh:
                    fh.seek(self.offset)
                    chunk = fh.read()
                self.offset += len(chunk)
                self.pending += chunk
                if b"\n" in chunk:
                    continue
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(FILE_POLL_SECONDS)

    async def close(self) -> None:
        self.path.unlink(missing_ok=True)


def reply_writer(settings: Settings, request_id: str) -> ReplyWriter:
    if settings.redis_url:
        return _RedisWriter(settings.redis_url, request_id)
    return _FileWriter(_file(settings, request_id))


def reply_reader(settings: Settings, request_id: str) -> ReplyReader:
    if settings.redis_url:
        return _RedisReader(settings.redis_url, request_id)
    return _FileReader(_file(settings, request_id))
