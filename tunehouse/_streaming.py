"""Server-Sent Events: a small incremental decoder, the mapping of SSE events to typed items, and
`EventStream`, a stream that follows a job across dropped connections and server restarts."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx

from tunehouse._base_client import (
    APIRequest,
    AsyncTransport,
    SyncTransport,
    connection_error,
    raw,
    retry_delay,
)
from tunehouse._exceptions import APIConnectionError, status_error
from tunehouse.types import JobEvent, MetricRow, StreamEnd, StreamItem

# a stream is a long GET: no read timeout beyond the server's keep-alives (sent every 15 s)
STREAM_TIMEOUT = httpx.Timeout(10.0, read=60.0)
# backoff 0.5, 1, 2, 4, 8, 8, 8, 8 s: about 40 s to ride out an API restart (the server drains on
# SIGTERM and a single instance takes seconds to come back)
STREAM_RECONNECTS = 8


@dataclass
class ServerSentEvent:
    event: str
    data: str
    id: str | None


class SSEDecoder:
    """Feed it lines (without newlines); it yields an event at each blank line (the SSE framing)."""

    def __init__(self) -> None:
        self._event = "message"
        self._data: list[str] = []
        self.last_event_id: str | None = None

    def feed(self, line: str) -> Iterator[ServerSentEvent]:
        if not line:
            if self._data:
                yield ServerSentEvent(self._event, "\n".join(self._data), self.last_event_id)
            self._event, self._data = "message", []
            return
        if line.startswith(":"):
            return  # a comment / keep-alive
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            self.last_event_id = value


def to_item(sse: ServerSentEvent) -> StreamItem | None:
    payload = json.loads(sse.data)
    if sse.event == "event":
        return JobEvent.model_validate(payload)
    if sse.event == "metrics":
        return MetricRow.model_validate(payload)
    if sse.event == "end":
        return StreamEnd.model_validate(payload)
    return None


def _decode(decoder: SSEDecoder, line: str) -> list[StreamItem]:
    """The typed items one SSE line completes (usually none, at a blank line one)."""
    return [item for sse in decoder.feed(line) if (item := to_item(sse)) is not None]


def _reconnect_delay(
    reconnects: int,
    *,
    response: httpx.Response | None = None,
    error: httpx.TransportError | None = None,
) -> float:
    """Seconds to wait before reconnecting, or the error that ends the stream when out of reconnects
    (or when the answer is one that a retry cannot change, e.g. a 404)."""
    delay = retry_delay("GET", "", reconnects, STREAM_RECONNECTS, response)
    if delay is not None:
        return delay
    if response is not None:
        raise status_error(response)
    if error is not None:
        raise connection_error(error) from error
    raise APIConnectionError("the stream ended before the job did")


@dataclass(frozen=True)
class EventStream:
    """A job's events and metric rows as they happen (history first), ending with a `StreamEnd`.

    A dropped connection, a 503 during an outage, or a stream the server ended early (it drains on
    SIGTERM) is resumed where it stopped (`Last-Event-ID`), so no item is lost or repeated."""

    path: str
    last_event_id: str | None = None
    # seconds without a byte before reconnecting; the server sends a keep-alive every 15 s
    read_timeout: float | None = None

    def _request(self, last_event_id: str | None) -> APIRequest[httpx.Response]:
        headers = {"Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        timeout = httpx.Timeout(10.0, read=self.read_timeout) if self.read_timeout else STREAM_TIMEOUT
        return raw("GET", self.path, headers=headers, timeout=timeout)

    def run_sync(self, transport: SyncTransport) -> Iterator[StreamItem]:
        decoder = SSEDecoder()
        decoder.last_event_id = self.last_event_id
        reconnects = 0
        while True:
            try:
                with transport.stream(self._request(decoder.last_event_id)) as response:
                    if not response.is_success:
                        response.read()
                        time.sleep(_reconnect_delay(reconnects, response=response))
                        reconnects += 1
                        continue
                    for line in response.iter_lines():
                        for item in _decode(decoder, line):
                            reconnects = 0
                            yield item
                            if isinstance(item, StreamEnd):
                                return
            except httpx.TransportError as exc:
                time.sleep(_reconnect_delay(reconnects, error=exc))
                reconnects += 1
                continue
            # ended before the job did: the server is draining (a restart, a deploy); come back
            time.sleep(_reconnect_delay(reconnects))
            reconnects += 1

    async def run_async(self, transport: AsyncTransport) -> AsyncIterator[StreamItem]:
        decoder = SSEDecoder()
        decoder.last_event_id = self.last_event_id
        reconnects = 0
        while True:
            try:
                async with transport.stream(self._request(decoder.last_event_id)) as response:
                    if not response.is_success:
                        await response.aread()
                        await asyncio.sleep(_reconnect_delay(reconnects, response=response))
                        reconnects += 1
                        continue
                    async for line in response.aiter_lines():
                        for item in _decode(decoder, line):
                            reconnects = 0
                            yield item
                            if isinstance(item, StreamEnd):
                                return
            except httpx.TransportError as exc:
                await asyncio.sleep(_reconnect_delay(reconnects, error=exc))
                reconnects += 1
                continue
            await asyncio.sleep(_reconnect_delay(reconnects))
            reconnects += 1
