"""A job's events and metric rows as Server-Sent Events, resumable with `Last-Event-ID`.

The DB is the record: every pass replays what is newer than the client's cursor. Redis pub/sub (when
configured) is the fast path: the worker publishes each metric row the moment the trainer logs it,
so a connected client sees it well under a second later instead of at the next DB flush. The SSE id
is the cursor `e<event seq>.m<metric step>`; the stream ends with an `end` event once the job has
ended and everything is sent.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from service.config import Settings
from service.db import get_sessionmaker
from service.jobs.schemas import TERMINAL_STATUSES, EventObject, metric_object
from service.models import Job, JobEvent, JobMetric

KEEPALIVE_SECONDS = 15.0
POLL_SECONDS = 0.25  # without Redis, how often the DB is asked for news
DB_CATCHUP_SECONDS = 1.0  # with Redis, how often the DB is still read (events live only there)


def channel(job_id: str) -> str:
    return f"tunehouse:job:{job_id}"


@dataclass
class Cursor:
    event_seq: int = 0
    metric_step: int = 0

    @classmethod
    def parse(cls, raw: str | None) -> Cursor:
        try:
            e, m = (raw or "").split(".")
            return cls(int(e.removeprefix("e")), int(m.removeprefix("m")))
        except ValueError:
            return cls()

    def __str__(self) -> str:
        return f"e{self.event_seq}.m{self.metric_step}"


def _frame(event: str, cursor: Cursor, data: dict[str, Any]) -> bytes:
    return f"event: {event}\nid: {cursor}\ndata: {json.dumps(data)}\n\n".encode()


def _read_since(job_id: str, cursor: Cursor) -> tuple[list[JobEvent], list[JobMetric], str]:
    with get_sessionmaker()() as session:
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
        status = session.scalar(select(Job.status).where(Job.id == job_id)) or "failed"
    return events, metrics, status


async def job_stream(job_id: str, cursor: Cursor, settings: Settings) -> AsyncIterator[bytes]:
    pubsub: Any = None
    if settings.redis_url:
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(settings.redis_url)
        pubsub = client.pubsub()
        await pubsub.subscribe(channel(job_id))  # before the first DB read, so nothing falls in between
    try:
        last_sent = time.monotonic()
        while True:
            events, metrics, status = await run_in_threadpool(_read_since, job_id, cursor)
            for ev in events:
                cursor.event_seq = ev.seq
                yield _frame("event", cursor, EventObject.of(ev).model_dump())
            for row in metrics:
                cursor.metric_step = row.step
                yield _frame("metrics", cursor, metric_object(row))
            if events or metrics:
                last_sent = time.monotonic()
            elif status in TERMINAL_STATUSES:
                yield _frame("end", cursor, {"object": "fine_tuning.job.stream_end", "status": status})
                return
            if len(events) == 1000 or len(metrics) == 1000:
                continue  # more history to replay
            if pubsub is None:
                await asyncio.sleep(POLL_SECONDS)
            else:
                deadline = time.monotonic() + DB_CATCHUP_SECONDS
                while (left := deadline - time.monotonic()) > 0:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
                    if message is None:
                        continue
                    row = json.loads(message["data"])
                    step = int(row["step"])
                    if step > cursor.metric_step + 1:
                        # a gap: a message was missed (e.g. published before our subscription took
                        # effect); the DB has every row, so read it rather than skip a step for good
                        break
                    # a step is sent once, except an evaluation that lands on a step already sent
                    if step == cursor.metric_step + 1 or (step == cursor.metric_step and "valid_loss" in row):
                        cursor.metric_step = step
                        last_sent = time.monotonic()
                        yield _frame("metrics", cursor, {"object": "fine_tuning.job.metric", **row})
            if time.monotonic() - last_sent > KEEPALIVE_SECONDS:
                last_sent = time.monotonic()
                yield b": keep-alive\n\n"
    finally:
        if pubsub is not None:
            await pubsub.unsubscribe()
            await pubsub.aclose()
            await client.aclose()
