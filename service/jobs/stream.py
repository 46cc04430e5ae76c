"""A job's events and metric rows as Server-Sent Events, resumable with `Last-Event-ID`.

The DB is the record: every pass replays what is newer than the client's cursor. Redis pub/sub (when
configured) is the fast path: the worker publishes each metric row as the trainer logs it (at most a
tenth of a second later), so a connected client sees it well under a second later instead of at the
next DB flush, and a committed event nudges the stream to read the DB at once
(service/jobs/live.py). The SSE id is the cursor `e<event seq>.m<metric step>`; the stream ends with
an `end` event once the job has ended and everything is sent.

Redis is optional and may come and go: without it (not configured, down, or dropped mid-stream) the
stream polls the DB four times a second and resubscribes when Redis is back. A database outage
keeps the stream open too (Redis rows still flow); the DB is read again once it answers. When the
server drains (SIGTERM), the stream sends a `retry:` hint and ends without `end`; the client
reconnects with `Last-Event-ID` and misses nothing.

The key the stream was opened with is checked again as it goes (service/auth.py `KeyWatch`): once it
is revoked or expires, the stream sends an `error` event (the 401 body a new request would get) and
ends, within `auth_cache_seconds` (5 s), the bound within which every server refuses its requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from service.config import Settings
from service.db import DB_UNAVAILABLE_ERRORS, get_sessionmaker
from service.db_slots import db_slot
from service.errors import AppError, ServiceUnavailable
from service.jobs import repository
from service.jobs.live import channel, message_rows
from service.jobs.schemas import TERMINAL_STATUSES, EventObject, metric_object
from service.models import JobEvent, JobMetric
from service.shutdown import draining

KEEPALIVE_SECONDS = 15.0
POLL_SECONDS = 0.25  # without Redis, how often the DB is asked for news
# with Redis, how often the DB is still read: for step events, and for any other event whose nudge
# (service/jobs/live.py) was lost
DB_CATCHUP_SECONDS = 1.0
REDIS_RETRY_SECONDS = 2.0  # after Redis failed, how long the stream polls the DB before trying again
REDIS_CONNECT_TIMEOUT = 1.0  # a down Redis must not hold up the DB fallback
RECONNECT_MS = 1000  # the `retry:` hint sent when the server drains: clients come back after ~1 s
DRAIN_FRAME = f"retry: {RECONNECT_MS}\n: server shutting down; reconnect with Last-Event-ID\n\n".encode()
REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)

# the database is down, or busy past the wait for a slot: either way, read it again at the next pass
_DB_NOT_NOW: tuple[type[Exception], ...] = (*DB_UNAVAILABLE_ERRORS, ServiceUnavailable)
log = logging.getLogger("tunehouse.api")


# The `id:` of each frame, `e<event seq>m<metric step>`. Nine digits a side: seq and step are 32-bit
# columns, and a bound a regular expression can state exactly lets the OpenAPI document say which
# Last-Event-ID values are accepted. Letters and digits only, which any HTTP tool can put in a header
# (Schemathesis generates header values from those alone, issue 56); the dotted `e12.m40` that earlier
# versions sent is still accepted, so a stream cut by an upgrade resumes
CURSOR_PATTERN = r"^e([0-9]{1,9})[.]?m([0-9]{1,9})$"
_CURSOR = re.compile(CURSOR_PATTERN)


@dataclass
class Cursor:
    event_seq: int = 0
    metric_step: int = 0

    @classmethod
    def parse(cls, raw: str | None) -> Cursor:
        """The `id:` this stream sent (`Last-Event-ID`); none = from the start. ValueError when it is not
        one (garbage, or a number no 32-bit column holds)."""
        if not raw:
            return cls()
        match = _CURSOR.match(raw)
        if match is None:
            raise ValueError(f"'{raw[:40]}' is not a stream position (expected e<event>m<step>)")
        return cls(int(match[1]), int(match[2]))

    def __str__(self) -> str:
        return f"e{self.event_seq}m{self.metric_step}"


def key_recheck_seconds(settings: Settings) -> float:
    """How often a stream re-reads its key's row. A revocation must end it within auth_cache_seconds,
    as it does new requests: a read every this long, plus at most one pass's wait for news
    (DB_CATCHUP_SECONDS), plus a second for the read itself on a loaded server (one read per stream
    every 3 s by default)."""
    return max(0.0, settings.auth_cache_seconds - DB_CATCHUP_SECONDS - 1.0)


def _error_frame(error: AppError) -> bytes:
    return f"event: error\ndata: {json.dumps(error.body())}\n\n".encode()


def _frame(event: str, cursor: Cursor, data: dict[str, Any]) -> bytes:
    return f"event: {event}\nid: {cursor}\ndata: {json.dumps(data)}\n\n".encode()


def _settled(status: str, worker_id: str | None, heartbeat_at: float | None, lease_timeout: float) -> bool:
    """Whether nothing more will be written for a job in `status`. A trainer writes its own final
    status last, but a cancel comes from the API while the trainer may still run: it writes its last
    rows and a "Training stopped" event within a control poll, then its worker releases the job
    (`service/jobs/lifecycle.py` `release`). A job whose worker died meanwhile counts as settled once its last
    heartbeat is a lease timeout old."""
    if status not in TERMINAL_STATUSES:
        return False
    if status != "cancelled" or worker_id is None:
        return True
    return heartbeat_at is None or heartbeat_at < time.time() - lease_timeout


def _read_since(
    job_id: str, cursor: Cursor, lease_timeout: float
) -> tuple[list[JobEvent], list[JobMetric], str, bool]:
    """New events and metric rows after `cursor`, the job's status, and whether it is settled.

    The status is read first: each statement sees what was committed before it began, so once the
    status says settled, the events and rows read after it are the job's last ones."""
    with get_sessionmaker()() as session:
        row = repository.liveness(session, job_id)
        events = list(
            session.scalars(
                select(JobEvent)
                .where(JobEvent.job_id == job_id, JobEvent.seq > cursor.event_seq)
                .order_by(JobEvent.seq)
                .limit(1000)
            )
        )
        metrics = list(
            session.scalars(
                select(JobMetric)
                .where(JobMetric.job_id == job_id, JobMetric.step > cursor.metric_step)
                .order_by(JobMetric.step)
                .limit(1000)
            )
        )
    if row is None:  # deleted meanwhile: nothing more will come
        return events, metrics, "failed", True
    status, worker_id, heartbeat_at = row
    return events, metrics, status, _settled(status, worker_id, heartbeat_at, lease_timeout)


class _LiveFeed:
    """The Redis pub/sub subscription of one stream, or none: it is optional and may drop at any time.

    Any Redis error closes the subscription; the stream then polls the DB every POLL_SECONDS and tries
    to subscribe again every REDIS_RETRY_SECONDS. Subscribing happens before the next DB read, so a
    row published in between is still read from the DB.
    """

    def __init__(self, url: str, job_id: str) -> None:
        self.url, self.job_id = url, job_id
        self.pubsub: Any = None
        self.client: Any = None
        self.retry_at = 0.0

    async def connect(self) -> None:
        if self.pubsub is not None or not self.url or time.monotonic() < self.retry_at:
            return
        import redis.asyncio

        # health checks: a subscription whose server restarted can sit on a dead socket and read
        # silence forever; a PING on an idle connection surfaces that as an error, so we resubscribe
        self.client = redis.asyncio.Redis.from_url(
            self.url,
            socket_connect_timeout=REDIS_CONNECT_TIMEOUT,
            retry=None,
            health_check_interval=REDIS_RETRY_SECONDS,
        )
        self.pubsub = self.client.pubsub()
        try:
            await self.pubsub.subscribe(channel(self.job_id))
        except REDIS_ERRORS as exc:
            await self.drop(exc)

    async def drop(self, exc: BaseException | None = None) -> None:
        if exc is not None:
            log.warning("stream %s: Redis unavailable (%s); reading the DB instead", self.job_id, exc)
            self.retry_at = time.monotonic() + REDIS_RETRY_SECONDS
        pubsub, client, self.pubsub, self.client = self.pubsub, self.client, None, None
        try:
            if pubsub is not None:
                await pubsub.aclose()
            if client is not None:
                await client.aclose()
        except REDIS_ERRORS:
            pass  # closing a dead connection

    async def get(self, timeout: float) -> dict[str, Any] | None:
        """The next published row within `timeout`; None on silence or when Redis went away."""
        if self.pubsub is None:
            return None
        try:
            message = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
        except REDIS_ERRORS as exc:
            await self.drop(exc)
            return None
        return None if message is None else dict(json.loads(message["data"]))


def _live_frames(rows: list[dict[str, Any]], cursor: Cursor) -> tuple[list[bytes], bool]:
    """The frames of a live message's rows not sent yet, moving the cursor; and whether a row was
    missing before them (a gap: a message was missed, e.g. published before the subscription took
    effect; the DB has every row, so the caller reads it rather than skip a step for good)."""
    frames: list[bytes] = []
    for row in rows:
        step = int(row["step"])
        if step > cursor.metric_step + 1:
            return frames, True
        # a step is sent once, except an evaluation that lands on a step already sent
        if step == cursor.metric_step + 1 or (step == cursor.metric_step and "valid_loss" in row):
            cursor.metric_step = step
            frames.append(_frame("metrics", cursor, {"object": "fine_tuning.job.metric", **row}))
    return frames, False


async def job_stream(
    job_id: str,
    cursor: Cursor,
    settings: Settings,
    refusal: Callable[[], Awaitable[AppError | None]] | None = None,
) -> AsyncIterator[bytes]:
    """The stream's frames; `refusal` (asked once a pass) says when the caller's key no longer holds."""
    live = _LiveFeed(settings.redis_url, job_id)
    try:
        last_sent = time.monotonic()
        while True:
            if draining():
                # the server is stopping: tell the client to come back (to the next instance) soon
                yield DRAIN_FRAME
                return
            if refusal is not None and (error := await refusal()) is not None:
                yield _error_frame(error)  # revoked or expired: a reconnect would get this as a 401
                return
            await live.connect()
            try:
                async with db_slot():
                    events, metrics, status, settled = await run_in_threadpool(
                        _read_since, job_id, cursor, settings.lease_timeout_seconds
                    )
            except _DB_NOT_NOW as exc:
                # the connection stays open: Redis (if up) still brings metric rows, and the DB is
                # read again at the next pass; the cursor makes the catch-up exact
                log.warning("stream %s: database unavailable (%s)", job_id, type(exc).__name__)
                events, metrics, status, settled = [], [], "running", False
            for ev in events:
                cursor.event_seq = ev.seq
                yield _frame("event", cursor, EventObject.of(ev).model_dump())
            for row in metrics:
                cursor.metric_step = row.step
                yield _frame("metrics", cursor, metric_object(row))
            if events or metrics:
                last_sent = time.monotonic()
            if len(events) == 1000 or len(metrics) == 1000:
                continue  # more history to replay
            if settled:  # read before the rows (_read_since): nothing newer can come
                yield _frame("end", cursor, {"object": "fine_tuning.job.stream_end", "status": status})
                return
            deadline = time.monotonic() + (DB_CATCHUP_SECONDS if live.pubsub is not None else POLL_SECONDS)
            while (left := deadline - time.monotonic()) > 0 and not draining():
                if live.pubsub is None:
                    await asyncio.sleep(min(left, POLL_SECONDS))
                    continue
                published = await live.get(left)
                if published is None:
                    continue
                rows = message_rows(published)
                if rows is None:
                    break  # a nudge (service/jobs/live.py): an event was committed, read the DB now
                frames, gap = _live_frames(rows, cursor)
                if frames:
                    last_sent = time.monotonic()
                    yield b"".join(frames)  # one write for the message's rows
                if gap:
                    break
            if time.monotonic() - last_sent > KEEPALIVE_SECONDS:
                last_sent = time.monotonic()
                yield b": keep-alive\n\n"
    finally:
        await live.drop()
