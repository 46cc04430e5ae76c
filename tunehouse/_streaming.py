"""Server-Sent Events: a small incremental decoder and the mapping of SSE events to typed items."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from tunehouse.types import JobEvent, MetricRow, StreamEnd, StreamItem


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
