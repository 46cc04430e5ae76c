"""Take the images out of an uploaded JSONL stream as it passes, so that no line holds one in memory.

An image row carries its images as base64 ``data:`` URLs of up to ~13.4 MB of text each (10 MB an image,
OpenAI's limit), ten to an example: a line of ~134 MB. The upload validator holds a line to parse it
(``service.files.validation``), capped at 4 MB. ``DataUrlSplitter`` sits in front of it: every string
value of a ``"url"`` key that starts with ``data:`` is streamed, a chunk at a time, into a sink of its
own (``open_sink``: the sink decodes the base64 into a temporary file and checks the image there), and
the line the validator parses gets a short placeholder string in its place (what the sink's ``finish``
returns). The stored file is the upload as sent: the splitter only changes what the validator reads.

It reads the bytes, not the JSON: a ``"url"`` key is found by its bytes (``"url"``, up to 16 whitespace
bytes, ``:``, up to 16 more, ``"``), which inside a JSON string can only appear escaped (a string holds
no bare quote). A ``url`` written otherwise (``"\\u0075rl"``, more whitespace) is not taken out: it stays
in its line, and counts against the line cap like any text. Escapes inside the data are decoded
(``\\/``, ``\\u002B``; ``\\n``, ``\\r`` and ``\\t`` are line breaks of the base64, dropped); a raw newline
before the closing quote ends the line and leaves an unterminated string for the validator to refuse.

>>> class Sink:
...     def __init__(self, header): self.header, self.data = header, b""
...     def write(self, data): self.data += data
...     def finish(self): return b'"<image>"'
>>> sinks = []
>>> splitter = DataUrlSplitter(lambda header: sinks.append(Sink(header)) or sinks[-1])
>>> out = splitter.feed(b'{"image_url": {"url": "data:image/png;base64,iVBO')
>>> out += splitter.feed(b'Rw0K\\\\/Ggo="}}\\n') + splitter.flush()
>>> out, sinks[0].header, sinks[0].data
(b'{"image_url": {"url": "<image>"}}\\n', 'data:image/png;base64', b'iVBORw0K/Ggo=')
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Protocol

from trainers.chat.images import MAX_DATA_URL_HEADER

# (no newline: a JSONL line has none, so a key and its value are on one line)
_KEY = re.compile(rb'"url"[ \t\r]{0,16}:[ \t\r]{0,16}"')
# a chunk's tail that may be the start of a _KEY match: kept unsent until the next chunk says
_PARTIAL = re.compile(rb'"(?:u(?:r(?:l(?:"[ \t\r]{0,16}(?::[ \t\r]{0,16})?)?)?)?)?\Z')
_CARRY = 5 + 16 + 1 + 16
_STOP = re.compile(rb'["\\\n]')
_DROPPED_ESCAPES = frozenset(b"nrt")  # line breaks and tabs of a base64 text: not data
_SCAN, _VALUE, _DATA = 0, 1, 2


class Sink(Protocol):
    """Where one data URL's payload goes: its base64 text, as it comes."""

    def write(self, data: bytes) -> None: ...

    def finish(self) -> bytes:
        """The JSON string (quotes included) the line gets in the data URL's place."""
        ...


class DataUrlSplitter:
    """Passes a byte stream through (``feed``, then ``flush`` at its end), each ``"url"``'s ``data:``
    string diverted into ``open_sink(header)``'s sink (``header``: the text before the comma)."""

    def __init__(self, open_sink: Callable[[str], Sink]) -> None:
        self._open_sink = open_sink
        self._state = _SCAN
        self._held = b""  # SCAN: the unsent tail; VALUE: the string's start; DATA: a split escape
        self._sink: Sink | None = None

    def feed(self, chunk: bytes) -> bytes:
        out = bytearray()
        data = self._held + chunk
        self._held = b""
        at = 0
        while at < len(data):
            if self._state == _SCAN:
                at = self._scan(data, at, out)
            elif self._state == _VALUE:
                at = self._value(data, at, out)
            else:
                at = self._payload(data, at, out)
        return bytes(out)

    def flush(self) -> bytes:
        """What is still held at the end of the stream (an unterminated data URL is left unterminated)."""
        held, self._held = self._held, b""
        if self._state == _DATA:
            self._state, self._sink = _SCAN, None
            return b'"'  # an unterminated string: the line is not valid JSON
        self._state = _SCAN
        return held

    def _scan(self, data: bytes, at: int, out: bytearray) -> int:
        for match in _KEY.finditer(data, at):
            if _escaped(data, match.start()):
                continue
            out += data[at : match.end() - 1]
            self._state = _VALUE
            return match.end() - 1  # the value's opening quote
        keep = _partial_start(data, max(at, len(data) - _CARRY))
        out += data[at:keep]
        self._held = data[keep:]
        return len(data)

    def _value(self, data: bytes, at: int, out: bytearray) -> int:
        """The start of a ``url`` value: diverted once it shows ``data:...,``, else sent on as it is."""
        head = data[at:]  # (what was held is at its start: ``feed`` put it there)
        end = _header_end(head)
        if end is not None and head[end] == ord(",") and end <= MAX_DATA_URL_HEADER:
            header = _unescaped(head[1:end])
            if header is not None and header[:5].lower() == "data:":
                self._sink = self._open_sink(header)
                self._state = _DATA
                return at + end + 1
        elif end is None and len(head) <= MAX_DATA_URL_HEADER and b"data:".startswith(head[1:6].lower()):
            self._held = head  # not decided yet: wait for more
            return len(data)
        out += head[:1]  # not a data URL: the quote goes on, and the rest is scanned as usual
        self._state = _SCAN
        return at + 1

    def _payload(self, data: bytes, at: int, out: bytearray) -> int:
        assert self._sink is not None
        stop = _STOP.search(data, at)
        if stop is None:
            self._sink.write(data[at:])
            return len(data)
        if stop.start() > at:
            self._sink.write(data[at : stop.start()])
        byte = data[stop.start()]
        if byte == ord('"'):
            out += self._sink.finish()
            self._state, self._sink = _SCAN, None
            return stop.start() + 1
        if byte == ord("\n"):  # the line ended inside the string: leave it unterminated
            self._state, self._sink = _SCAN, None
            out += b'"'
            return stop.start()
        return self._escape(data, stop.start())

    def _escape(self, data: bytes, at: int) -> int:
        """The escape at ``data[at]`` (a backslash) decoded into the sink; held whole when split."""
        assert self._sink is not None
        if at + 1 >= len(data):
            self._held = data[at:]
            return len(data)
        kind = data[at + 1]
        if kind == ord("u"):
            if at + 6 > len(data):
                self._held = data[at:]
                return len(data)
            try:
                char = chr(int(data[at + 2 : at + 6], 16))
            except ValueError:
                char = "\\"  # not an escape: not base64 either, as the sink will say
            self._sink.write(char.encode("utf-8", "replace"))
            return at + 6
        if kind not in _DROPPED_ESCAPES:
            self._sink.write(bytes([kind]) if kind == ord("/") else b"\\" + bytes([kind]))
        return at + 2


def _partial_start(data: bytes, start: int) -> int:
    """Where, from ``start`` on, ``data`` ends with what may begin a ``"url":`` match (its length if
    nothing may)."""
    for quote in range(data.find(b'"', start), len(data)) if b'"' in data[start:] else ():
        if data[quote] == ord('"') and _PARTIAL.match(data, quote):
            return quote
    return len(data)


_HEADER_STOP = re.compile(rb'[,"\n]')


def _header_end(head: bytes) -> int | None:
    """Where a string's first part ends: its first comma, its closing quote or a newline (None: not
    in ``head`` yet)."""
    for stop in _HEADER_STOP.finditer(head, 1):
        if head[stop.start()] != ord('"') or not _escaped(head, stop.start()):
            return stop.start()
    return None


def _unescaped(raw: bytes) -> str | None:
    """A JSON string's raw text decoded (``image\\/png``); None when it is not valid JSON text."""
    try:
        text = json.loads(b'"' + raw + b'"')
    except ValueError:
        return None
    return text if isinstance(text, str) else None


def _escaped(data: bytes, quote: int) -> bool:
    """Whether the quote at ``data[quote]`` is escaped (an odd run of backslashes before it)."""
    run = 0
    while quote - run - 1 >= 0 and data[quote - run - 1] == ord("\\"):
        run += 1
    return run % 2 == 1
