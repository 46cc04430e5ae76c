"""HTTP plumbing shared by `Client` and `AsyncClient`: configuration, retries with backoff, errors.

Retried: connection errors, timeouts, and 408 / 409 / 429 / 5xx answers, up to `max_retries` times with
exponential backoff and jitter (honouring `Retry-After` when the server sends one). Everything else
raises at once, as the typed error for its status (see `tunehouse._exceptions`).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

import httpx

from tunehouse._exceptions import APIConnectionError, APITimeoutError, status_error

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = 60.0
DEFAULT_MAX_RETRIES = 2
RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
# never retried: a retried POST /cancel is harmless, a retried POST /files would upload twice
_NON_IDEMPOTENT_SAFE = ("/cancel", "/pause", "/resume")


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


def retry_delay(
    method: str, path: str, attempt: int, max_retries: int, response: httpx.Response | None
) -> float | None:
    """Seconds to wait before the next try, or None to give up. `response` is None after a transport error."""
    if attempt >= max_retries:
        return None
    if method != "GET" and not path.endswith(_NON_IDEMPOTENT_SAFE):
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


class SyncTransport:
    def __init__(self, base_url: str, api_key: str, timeout: float, max_retries: int) -> None:
        self.max_retries = max_retries
        self.http = httpx.Client(
            base_url=base_url, timeout=timeout, headers={"Authorization": f"Bearer {api_key}"}
        )

    def request(
        self, method: str, path: str, *, timeout: float | None = None, **kwargs: Any
    ) -> httpx.Response:
        attempt = 0
        while True:
            try:
                response = self.http.request(method, path, timeout=timeout or self.http.timeout, **kwargs)
            except httpx.TransportError as exc:
                delay = retry_delay(method, path, attempt, self.max_retries, None)
                if delay is None:
                    raise connection_error(exc) from exc
            else:
                if response.is_success:
                    return response
                delay = retry_delay(method, path, attempt, self.max_retries, response)
                if delay is None:
                    raise status_error(response)
            time.sleep(delay)
            attempt += 1

    def close(self) -> None:
        self.http.close()


class AsyncTransport:
    def __init__(self, base_url: str, api_key: str, timeout: float, max_retries: int) -> None:
        self.max_retries = max_retries
        self.http = httpx.AsyncClient(
            base_url=base_url, timeout=timeout, headers={"Authorization": f"Bearer {api_key}"}
        )

    async def request(
        self, method: str, path: str, *, timeout: float | None = None, **kwargs: Any
    ) -> httpx.Response:
        attempt = 0
        while True:
            try:
                response = await self.http.request(
                    method, path, timeout=timeout or self.http.timeout, **kwargs
                )
            except httpx.TransportError as exc:
                delay = retry_delay(method, path, attempt, self.max_retries, None)
                if delay is None:
                    raise connection_error(exc) from exc
            else:
                if response.is_success:
                    return response
                delay = retry_delay(method, path, attempt, self.max_retries, response)
                if delay is None:
                    raise status_error(response)
            await asyncio.sleep(delay)
            attempt += 1

    async def aclose(self) -> None:
        await self.http.aclose()
