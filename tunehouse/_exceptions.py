"""Errors the SDK raises. Catch `APIError` for everything that came from (or failed to reach) the API.

TunehouseError
 └── APIError(message, request)
      ├── APIConnectionError          the server could not be reached
      │    └── APITimeoutError        it did not answer in time
      └── APIStatusError(status_code, request_id, body)
           ├── BadRequestError            400
           ├── AuthenticationError        401
           ├── PermissionDeniedError      403
           ├── NotFoundError              404
           ├── ConflictError              409
           ├── UnprocessableEntityError   422
           ├── RateLimitError             429
           └── InternalServerError        5xx
"""

from __future__ import annotations

from typing import Any

import httpx


class TunehouseError(Exception):
    pass


class APIError(TunehouseError):
    def __init__(self, message: str, *, request: httpx.Request | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request = request


class APIConnectionError(APIError):
    def __init__(self, message: str = "Connection error.", *, request: httpx.Request | None = None) -> None:
        super().__init__(message, request=request)


class APITimeoutError(APIConnectionError):
    def __init__(self, *, request: httpx.Request | None = None) -> None:
        super().__init__("Request timed out.", request=request)


class APIStatusError(APIError):
    """The API answered with a 4xx or 5xx; `param` and `code` come from its error envelope."""

    def __init__(self, message: str, *, response: httpx.Response, body: Any) -> None:
        super().__init__(message, request=response.request)
        self.response = response
        self.status_code = response.status_code
        self.request_id: str | None = response.headers.get("x-request-id")
        self.body = body
        error = body.get("error") if isinstance(body, dict) else None
        self.param: str | None = error.get("param") if isinstance(error, dict) else None
        self.code: str | None = error.get("code") if isinstance(error, dict) else None
        self.type: str | None = error.get("type") if isinstance(error, dict) else None

    def __str__(self) -> str:
        rid = f" (request id {self.request_id})" if self.request_id else ""
        return f"Error code {self.status_code}: {self.message}{rid}"


class BadRequestError(APIStatusError):
    pass


class AuthenticationError(APIStatusError):
    pass


class PermissionDeniedError(APIStatusError):
    pass


class NotFoundError(APIStatusError):
    pass


class ConflictError(APIStatusError):
    pass


class UnprocessableEntityError(APIStatusError):
    pass


class RateLimitError(APIStatusError):
    pass


class InternalServerError(APIStatusError):
    pass


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    422: UnprocessableEntityError,
    429: RateLimitError,
}


def status_error(response: httpx.Response) -> APIStatusError:
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    message = message or (body if isinstance(body, str) and body else f"HTTP {response.status_code}")
    cls = _BY_STATUS.get(
        response.status_code, InternalServerError if response.status_code >= 500 else APIStatusError
    )
    return cls(str(message), response=response, body=body)
