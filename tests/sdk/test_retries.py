"""SDK retries against real sockets: which answers are retried (408, 409, 429, 5xx, dropped connections,
timeouts) and which are not, the exponential backoff's bounds, `Retry-After`, and POSTs that are never
repeated (job creation is, with its Idempotency-Key: tests/sdk/test_idempotency.py). The servers are
real HTTP/TCP servers on localhost that answer from a script."""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

import tunehouse
from tunehouse._base_client import retry_delay

ERROR = b'{"error": {"message": "scripted", "type": "server_error", "param": null, "code": null}}'
EMPTY_LIST = b'{"object": "list", "data": [], "has_more": false}'


@dataclass
class Script:
    """What the server answers, in order (then 200 with an empty list), and when each request came."""

    answers: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    delay_first: float = 0.0  # seconds to stall before the first answer (a client timeout)
    hits: list[float] = field(default_factory=list)

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.hits, self.hits[1:], strict=False)]


@pytest.fixture
def scripted() -> Iterator[tuple[str, Script]]:
    script = Script()

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            script.hits.append(time.monotonic())
            if len(script.hits) == 1 and script.delay_first:
                time.sleep(script.delay_first)
            status, headers = script.answers.pop(0) if script.answers else (200, {})
            body = EMPTY_LIST if status == 200 else ERROR
            self.send_response(status)
            for key, value in {"content-type": "application/json", **headers}.items():
                self.send_header(key, value)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        # server_close() joins the handler threads, so each closes its connection before the test
        # ends (daemon threads left a socket to the garbage collector: a ResourceWarning, once in CI)
        daemon_threads = False
        block_on_close = True

    Handler.timeout = 10  # an idle keep-alive connection cannot hold server_close() longer than this
    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", script
    finally:
        server.shutdown()
        server.server_close()


NOW = {"retry-after": "0"}


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504])
def test_each_retryable_status_is_retried(scripted: tuple[str, Script], status: int) -> None:
    url, script = scripted
    script.answers = [(status, NOW), (status, NOW)]
    with tunehouse.Client(base_url=url, api_key="k", max_retries=2) as client:
        assert client.files.list().data == []
    assert len(script.hits) == 3


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (400, tunehouse.BadRequestError),
        (401, tunehouse.AuthenticationError),
        (403, tunehouse.PermissionDeniedError),
        (404, tunehouse.NotFoundError),
        (422, tunehouse.UnprocessableEntityError),
        (501, tunehouse.InternalServerError),
    ],
)
def test_other_statuses_raise_at_once(
    scripted: tuple[str, Script], status: int, error: type[tunehouse.APIStatusError]
) -> None:
    url, script = scripted
    script.answers = [(status, NOW)]
    with tunehouse.Client(base_url=url, api_key="k", max_retries=3) as client, pytest.raises(error) as caught:
        client.files.list()
    assert caught.value.status_code == status and len(script.hits) == 1


def test_gives_up_after_max_retries_with_the_typed_error(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    script.answers = [(429, NOW)] * 5
    with (
        tunehouse.Client(base_url=url, api_key="k", max_retries=2) as client,
        pytest.raises(tunehouse.RateLimitError),
    ):
        client.files.list()
    assert len(script.hits) == 3


def test_posts_are_not_repeated_except_control_actions(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    script.answers = [(503, NOW)] * 6
    with tunehouse.Client(base_url=url, api_key="k", max_retries=2) as client:
        with pytest.raises(tunehouse.InternalServerError):
            client.files.create(file=b'{"text": "x"}\n')  # a repeated upload would store the file twice
        assert len(script.hits) == 1
        with pytest.raises(tunehouse.InternalServerError):
            client.fine_tuning.jobs.cancel("ftjob-x")  # cancelling twice is harmless: retried
        assert len(script.hits) == 4


def test_backoff_doubles_within_its_jitter(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    script.answers = [(503, {}), (503, {})]  # no Retry-After: the client's own backoff
    with tunehouse.Client(base_url=url, api_key="k", max_retries=2) as client:
        client.files.list()
    first, second = script.gaps()
    # 0.5 s then 1 s, each times a jitter in [0.75, 1.25]; the upper bounds allow for a loaded machine
    assert 0.375 <= first < 0.625 + 0.5
    assert 0.75 <= second < 1.25 + 0.5


def test_backoff_bounds_and_cap() -> None:
    for attempt, base in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 8.0)]:
        delays = [retry_delay("GET", "/v1/files", attempt, 10, None) for _ in range(200)]
        assert all(d is not None and 0.75 * base <= d <= 1.25 * base for d in delays), (attempt, delays)
        spread = [d for d in delays if d is not None]
        assert max(spread) - min(spread) > 0.3 * base  # jitter: clients do not retry in lockstep
    assert retry_delay("GET", "/v1/files", 2, 2, None) is None  # out of attempts


def _answer(status: int, headers: dict[str, str]) -> httpx.Response:
    return httpx.Response(status, headers=headers, request=httpx.Request("GET", "http://x/v1/files"))


def test_retry_after_is_honoured_and_capped() -> None:
    assert retry_delay("GET", "/v1/files", 0, 2, _answer(429, {"retry-after": "7"})) == 7.0
    assert retry_delay("GET", "/v1/files", 0, 2, _answer(503, {"retry-after": "0.25"})) == 0.25
    assert retry_delay("GET", "/v1/files", 0, 2, _answer(503, {"retry-after": "3600"})) == 60.0
    # an HTTP-date Retry-After is not parsed: the client's own backoff applies
    fallback = retry_delay("GET", "/v1/files", 0, 2, _answer(503, {"retry-after": "Wed, 21 Oct 2037"}))
    assert fallback is not None and 0.375 <= fallback <= 0.625
    assert retry_delay("GET", "/v1/files", 0, 2, _answer(404, {"retry-after": "1"})) is None


def test_retry_after_from_the_server_sets_the_wait(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    script.answers = [(429, {"retry-after": "1.5"})]
    with tunehouse.Client(base_url=url, api_key="k", max_retries=1) as client:
        client.files.list()
    (gap,) = script.gaps()
    assert 1.5 <= gap < 1.5 + 0.75  # not the 0.5 s backoff


def test_a_timeout_is_retried(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    script.delay_first = 2.0
    with tunehouse.Client(base_url=url, api_key="k", max_retries=1, timeout=0.5) as client:
        assert client.files.list().data == []
    assert len(script.hits) == 2
    script.hits.clear()
    with tunehouse.Client(base_url=url, api_key="k", max_retries=0, timeout=0.5) as client:
        script.delay_first = 2.0
        with pytest.raises(tunehouse.APITimeoutError):
            client.files.list()


@pytest.fixture
def dropping() -> Iterator[tuple[str, list[int]]]:
    """A TCP server that closes the first N connections without answering, then speaks HTTP."""
    listener = socket.create_server(("127.0.0.1", 0))
    drops = [0]  # connections still to drop; the test sets it
    seen = [0]

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                seen[0] += 1
                if drops[0] > 0:
                    drops[0] -= 1
                    continue  # closed without a byte: the client sees the connection dropped
                conn.recv(65536)
                head = (
                    f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(EMPTY_LIST)}"
                )
                conn.sendall(head.encode() + b"\r\nconnection: close\r\n\r\n" + EMPTY_LIST)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", drops
    finally:
        listener.close()
    assert seen[0] >= 1


def test_dropped_connections_are_retried(dropping: tuple[str, list[int]]) -> None:
    url, drops = dropping
    drops[0] = 2
    with tunehouse.Client(base_url=url, api_key="k", max_retries=2) as client:
        assert client.files.list().data == []
    assert drops[0] == 0
    drops[0] = 5
    with (
        tunehouse.Client(base_url=url, api_key="k", max_retries=1) as client,
        pytest.raises(tunehouse.APIConnectionError),
    ):
        client.files.list()
    assert drops[0] == 3  # one try and one retry


def test_the_async_client_retries_the_same_way(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    script.answers = [(408, NOW), (504, {"retry-after": "0.5"}), (400, NOW)]

    async def run() -> None:
        async with tunehouse.AsyncClient(base_url=url, api_key="k", max_retries=3) as client:
            with pytest.raises(tunehouse.BadRequestError):
                await client.files.list()

    asyncio.run(run())
    assert len(script.hits) == 3 and script.gaps()[1] >= 0.5
