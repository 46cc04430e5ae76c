"""The splitter that takes data URLs out of an upload's byte stream (service/files/data_urls.py): over
rows split at every kind of chunk boundary, each ``"url"`` data URL's text reaches its sink whole and
decoded of JSON escapes, the line keeps everything else byte for byte, and what is not a data URL under a
``url`` key (text that quotes one, a short ``url``, an https URL) passes through untouched."""

from __future__ import annotations

import base64
import json
import random

import pytest

from service.files.data_urls import DataUrlSplitter


class _Sink:
    def __init__(self, header: str, sinks: list[_Sink]) -> None:
        self.header, self.data, self.number = header, b"", len(sinks)

    def write(self, data: bytes) -> None:
        self.data += data

    def finish(self) -> bytes:
        return json.dumps(f"IMAGE{self.number}").encode()


def _split(raw: bytes, cuts: list[int]) -> tuple[bytes, list[_Sink]]:
    sinks: list[_Sink] = []

    def open_sink(header: str) -> _Sink:
        sinks.append(_Sink(header, sinks))
        return sinks[-1]

    splitter = DataUrlSplitter(open_sink)
    out, previous = b"", 0
    for cut in [*cuts, len(raw)]:
        out += splitter.feed(raw[previous:cut])
        previous = cut
    return out + splitter.flush(), sinks


@pytest.mark.parametrize("seed", range(4))
def test_every_data_url_reaches_its_sink_whatever_the_chunks(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        payloads = [
            base64.b64encode(rng.randbytes(rng.randint(0, 400))).decode() for _ in range(rng.randint(0, 3))
        ]
        text = 'he wrote "url": "data:image/png;base64,AAAA" \\ and left' * rng.randint(0, 2)
        parts = [{"type": "text", "text": text}]
        parts += [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{p}"}} for p in payloads]
        row = {
            "messages": [{"role": "user", "content": parts}],
            "url": "https://x/y.png",
            "z": {"url": "data"},
        }
        line = json.dumps(row, ensure_ascii=rng.random() < 0.5)
        if rng.random() < 0.5:
            line = line.replace("/", "\\/")  # a JSON encoder may escape every slash
        if rng.random() < 0.5:
            line = line.replace("+", "\\u002B")
        if rng.random() < 0.3:
            line = line.replace("AB", "A\\nB")  # a base64 text's line breaks, escaped: not data
        raw = (line + "\n").encode()
        cuts = sorted(rng.sample(range(1, len(raw)), min(len(raw) - 1, rng.randint(0, 30))))
        out, sinks = _split(raw, cuts)
        read = json.loads(out)
        assert [p.get("image_url", {}).get("url") for p in read["messages"][0]["content"][1:]] == [
            f"IMAGE{k}" for k in range(len(payloads))
        ]
        assert (
            read["messages"][0]["content"][0] == parts[0]
            and read["url"] == row["url"]
            and read["z"] == row["z"]
        )
        assert [s.data.decode() for s in sinks] == payloads
        assert all(s.header == "data:image/png;base64" for s in sinks)


def test_a_line_that_ends_inside_a_data_url_stays_unterminated() -> None:
    out, sinks = _split(b'{"url": "data:image/png;base64,AAAA\n{"text": "next"}\n', [20])
    first, second = out.split(b"\n")[:2]
    with pytest.raises(json.JSONDecodeError):
        json.loads(first)
    assert json.loads(second) == {"text": "next"} and sinks[0].data == b"AAAA"


def test_a_quote_inside_a_key_is_not_a_url_key() -> None:
    """``"a\\"url": "data:..."``: the bytes ``"url":`` after an escaped quote belong to another key, whose
    value stays in its line as it is."""
    raw = b'{"a\\"url": "data:image/png;base64,AAAA", "b\\\\": {"url": "data:image/png;base64,BBBB"}}\n'
    out, sinks = _split(raw, [])
    assert json.loads(out) == {'a"url': "data:image/png;base64,AAAA", "b\\": {"url": "IMAGE0"}}
    assert [s.data for s in sinks] == [b"BBBB"]  # after an escaped backslash, a real quote: a real key
