"""HTTP plumbing shared by `Client` and `AsyncClient`: configuration, the description of one call,
retries with backoff, errors.

A resource method says once what to send and how to read the answer (an `APIRequest`); the two
transports below are the only places that do I/O, one blocking and one async, and they retry alike.

Retried: connection errors, timeouts, and 408 / 409 / 429 / 5xx answers, up to `max_retries` times with
exponential backoff and jitter (honouring `Retry-After` when the server sends one) — for GETs, the
control actions (cancel / pause / resume) and the POSTs the server deduplicates by their
`Idempotency-Key` (job creation). Everything else raises at once, as the typed error for its status
(see `tunehouse._exceptions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, Generic, TypeVar

import httpx

from tunehouse._exceptions import APIConnectionError, APITimeoutError, status_error

T = TypeVar("T")

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = 60.0
DEFAULT_MAX_RETRIES = 2
RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
# POSTs that are safe to repeat whatever happened to the first try: cancelling twice is harmless
_CONTROL_ACTIONS = ("/cancel", "/pause", "/resume")
IDEMPOTENCY_HEADER = "Idempotency-Key"

FileInput = str | Path | bytes | IO[bytes]
Timeout = float | httpx.Timeout


def resolve_config(base_url: str | None, api_key: str | None) -> tuple[str, str]:
    base = (base_url or os.environ.get("TUNEHOUSE_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    key = api_key or os.environ.get("TUNEHOUSE_API_KEY")
    if not key:
        raise ValueError(
            "no API key: pass api_key= or set TUNEHOUSE_API_KEY (create one: tunehouse keys create)"
        )
    return base, key


def new_idempotency_key() -> str:
    """One per logical create call; its automatic retries reuse it, so the server can answer a retry
    with the object the first try created."""
    return f"tunehouse-{uuid.uuid4()}"


def compact(**fields: Any) -> dict[str, Any]:
    """The fields that were given (None means "not given", so the server applies its default)."""
    return {k: v for k, v in fields.items() if v is not None}


def retry_delay(
    method: str,
    path: str,
    attempt: int,
    max_retries: int,
    response: httpx.Response | None,
    *,
    deduplicated: bool = False,
) -> float | None:
    """Seconds to wait before the next try, or None to give up. `response` is None after a transport
    error; `deduplicated`: the server answers a repeat of this POST with the first one's result."""
    if attempt >= max_retries:
        return None
    if method != "GET" and not deduplicated and not path.endswith(_CONTROL_ACTIONS):
        return None
    if response is not None and response.status_code not in RETRY_STATUSES:
        return None
    if response is not None:
        retry_after = response.headers.get("retry-after")
        if retry_after and retry_after.replace(".", "", 1).isdigit():
            return min(float(retry_after), 60.0)
    return float(min(8.0, 0.5 * 2**attempt) * (0.75 + random.random() / 2))


def connection_error(exc: httpx.TransportError) -> APIConnectionError:
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError()
    return APIConnectionError(f"Connection error: {exc}")


def _identity(response: httpx.Response) -> httpx.Response:
    return response


@dataclass(frozen=True)
class APIRequest(Generic[T]):
    """One API call as data: what to send and how to read a successful answer. Built once per logical
    call, so every retry of it sends the same bytes and the same `Idempotency-Key`."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    params: Mapping[str, Any] | None = None
    json: Any = None
    # multipart: form fields, and the one file (sent as the form field `file`)
    data: Mapping[str, Any] | None = None
    upload: FileInput | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout: Timeout | None = None
    # the server deduplicates this POST by its Idempotency-Key, so a retry cannot create a second object
    deduplicated: bool = False

    def with_params(self, **params: Any) -> APIRequest[T]:
        return replace(self, params={**(self.params or {}), **params})

    @contextlib.contextmanager
    def arguments(self) -> Iterator[dict[str, Any]]:
        """httpx's keyword arguments for one try; a file named by path is opened for that try only."""
        kwargs: dict[str, Any] = {"headers": dict(self.headers)}
        if self.params:
            kwargs["params"] = dict(self.params)
        if self.json is not None:
            kwargs["json"] = self.json
        if self.data is not None:
            kwargs["data"] = dict(self.data)
        if self.upload is None:
            yield kwargs
            return
        with contextlib.ExitStack() as stack:
            kwargs["files"] = {"file": _file_part(self.upload, stack)}
            yield kwargs

    def run_sync(self, transport: SyncTransport) -> T:
        return self.parse(transport.send(self))

    async def run_async(self, transport: AsyncTransport) -> T:
        return self.parse(await transport.send(self))

    def retry_delay(self, attempt: int, max_retries: int, response: httpx.Response | None) -> float | None:
        return retry_delay(
            self.method, self.path, attempt, max_retries, response, deduplicated=self.deduplicated
        )


def _file_part(file: FileInput, stack: contextlib.ExitStack) -> tuple[str, Any]:
    if isinstance(file, str | Path):
        path = Path(file)
        return path.name, stack.enter_context(path.open("rb"))
    if isinstance(file, bytes):
        return "upload.jsonl", file
    return Path(getattr(file, "name", "upload.jsonl")).name, file


def raw(method: str, path: str, **fields: Any) -> APIRequest[httpx.Response]:
    """A request whose answer is read by its caller (a stream, a download)."""
    return APIRequest(method, path, _identity, **fields)


class SyncTransport:
    def __init__(self, base_url: str, api_key: str, timeout: float, max_retries: int) -> None:
        self.max_retries = max_retries
        self.http = httpx.Client(
            base_url=base_url, timeout=timeout, headers={"Authorization": f"Bearer {api_key}"}
        )

    def send(self, request: APIRequest[Any]) -> httpx.Response:
        """The successful answer to `request`, retried as `retry_delay` allows; else its typed error."""
        attempt = 0
        while True:
            try:
                with request.arguments() as kwargs:
                    response = self.http.request(
                        request.method,
                        request.path,
                        timeout=request.timeout or self.http.timeout,
                        **kwargs,
                    )
            except httpx.TransportError as exc:
                delay = request.retry_delay(attempt, self.max_retries, None)
                if delay is None:
                    raise connection_error(exc) from exc
            else:
                if response.is_success:
                    return response
                delay = request.retry_delay(attempt, self.max_retries, response)
                if delay is None:
                    raise status_error(response)
            time.sleep(delay)
            attempt += 1

    @contextlib.contextmanager
    def stream(self, request: APIRequest[Any]) -> Iterator[httpx.Response]:
        """The answer with its body unread (one try: its caller decides about reconnecting)."""
        with (
            request.arguments() as kwargs,
            self.http.stream(
                request.method, request.path, timeout=request.timeout or self.http.timeout, **kwargs
            ) as response,
        ):
            yield response

    def close(self) -> None:
        self.http.close()


class AsyncTransport:
    def __init__(self, base_url: str, api_key: str, timeout: float, max_retries: int) -> None:
        self.max_retries = max_retries
        self.http = httpx.AsyncClient(
            base_url=base_url, timeout=timeout, headers={"Authorization": f"Bearer {api_key}"}
        )

    async def send(self, request: APIRequest[Any]) -> httpx.Response:
        """The successful answer to `request`, retried as `retry_delay` allows; else its typed error."""
        attempt = 0
        while True:
            try:
                with request.arguments() as kwargs:
                    response = await self.http.request(
                        request.method,
                        request.path,
                        timeout=request.timeout or self.http.timeout,
                        **kwargs,
                    )
            except httpx.TransportError as exc:
                delay = request.retry_delay(attempt, self.max_retries, None)
                if delay is None:
                    raise connection_error(exc) from exc
            else:
                if response.is_success:
                    return response
                delay = request.retry_delay(attempt, self.max_retries, response)
                if delay is None:
                    raise status_error(response)
            await asyncio.sleep(delay)
            attempt += 1

    @contextlib.asynccontextmanager
    async def stream(self, request: APIRequest[Any]) -> AsyncIterator[httpx.Response]:
        """The answer with its body unread (one try: its caller decides about reconnecting)."""
        with request.arguments() as kwargs:
            async with self.http.stream(
                request.method, request.path, timeout=request.timeout or self.http.timeout, **kwargs
            ) as response:
                yield response

    async def aclose(self) -> None:
        await self.http.aclose()
