"""One error hierarchy, rendered by one handler as OpenAI's envelope:
`{"error": {"message", "type", "param", "code"}}`.

    AppError
     ├── BadRequest            400 invalid_request_error
     ├── Unauthorized          401 authentication_error
     ├── Forbidden             403 invalid_request_error (e.g. deleting a base model)
     ├── NotFound              404 invalid_request_error (also another tenant's object)
     ├── Conflict              409 invalid_request_error (e.g. cancelling a finished job)
     ├── PayloadTooLarge       413 invalid_request_error
     ├── NotImplementedYet     501 not_implemented
     └── ServiceUnavailable    503 server_error, with Retry-After (e.g. the database is down)

Anything else a route raises is a bug: service.middleware answers it with a 500 in the same envelope,
carrying the request id, and keeps the connection usable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from service.db import DB_UNAVAILABLE_ERRORS

if TYPE_CHECKING:
    from fastapi import FastAPI, Request

# fastapi itself is imported where the handlers are installed: a trainer process raises these errors
# (through service.storage) but never answers HTTP, and importing fastapi would lengthen every start

# How long a client should wait before retrying a 503. The database comes back in seconds after a
# restart or failover (measured in tests/service/test_db_outage.py); 2 s keeps retries cheap and quick.
RETRY_AFTER_SECONDS = 2


class AppError(Exception):
    status_code = 500
    type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str] | None:
        return None

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers())


class BadRequest(AppError):
    status_code = 400
    type = "invalid_request_error"


class Unauthorized(AppError):
    status_code = 401
    type = "authentication_error"


class Forbidden(AppError):
    status_code = 403
    type = "invalid_request_error"


class NotFound(AppError):
    status_code = 404
    type = "invalid_request_error"


class Conflict(AppError):
    status_code = 409
    type = "invalid_request_error"


class PayloadTooLarge(AppError):
    status_code = 413
    type = "invalid_request_error"


class NotImplementedYet(AppError):
    status_code = 501
    type = "not_implemented"


class ServiceUnavailable(AppError):
    status_code = 503
    type = "server_error"

    def headers(self) -> dict[str, str] | None:
        return {"retry-after": str(RETRY_AFTER_SECONDS)}


def internal_error(request_id: str | None) -> JSONResponse:
    """The 500 for an unexpected exception: no detail leaks, the request id lets the operator find it."""
    where = f" (request id {request_id})" if request_id else ""
    body = {
        "error": {
            "message": f"The server had an error while processing your request{where}.",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
    return JSONResponse(body, status_code=500)


# --- OpenAPI: what the envelope looks like, and which statuses each operation documents -------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope, the body of every 4xx and 5xx."""

    error: ErrorDetail


_DESCRIPTIONS = {
    400: "Invalid request: the message names the `param` (or the file line) at fault",
    401: "Missing, invalid, revoked or expired API key",
    403: "The object exists but this key may not do that to it (e.g. delete a base model)",
    404: "No such object for this organization",
    409: "The object is not in a state that allows this",
    413: "Request body or uploaded file too large",
    501: "Not implemented yet on this deployment; the message says what is missing",
    503: "A dependency (the database) is unavailable; retry after `Retry-After` seconds",
}
_RETRY_AFTER_HEADER = {
    "Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route or router: each status with the error envelope as its body."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorResponse, "description": _DESCRIPTIONS[status]}
        if status == 503:
            entry["headers"] = _RETRY_AFTER_HEADER
        out[status] = entry
    return out


# --- handlers ------------------------------------------------------------------------------------------


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    # pydantic adds union-member tags ("constrained-int", "literal['auto']") to locations; they are not
    # parameters, so keep only field names and list indexes
    parts = [
        str(p)
        for p in loc
        if p not in ("body", "query", "path", "form") and (isinstance(p, int) or str(p).isidentifier())
    ]
    out = ""
    for part in parts:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out


def _drop_union_tags(loc: tuple[Any, ...], body: Any) -> tuple[Any, ...]:
    """Drop the tag pydantic puts in a location for a discriminated union member (a grader's `type`,
    e.g. `grader.string_check.operation`): a part that is the object's `type` but not one of its keys.

    >>> _drop_union_tags(("body", "grader", "multi", "calculate_output"),
    ...                  {"grader": {"type": "multi", "calculate_output": "x"}})
    ('body', 'grader', 'calculate_output')
    """
    out: list[Any] = []
    node: Any = body
    for part in loc:
        if part == "body" and not out:
            out.append(part)
            continue
        if isinstance(node, dict) and part not in node and part == node.get("type"):
            continue
        out.append(part)
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            node = None
    return tuple(out)


def _allowed_methods(request: Request) -> str:
    # Starlette's 405 lists the methods of the first route whose path matched; a path served by
    # several routes (GET and POST /v1/files) must list them all
    from fastapi.routing import iter_route_contexts

    methods: set[str] = set()
    for route in iter_route_contexts(request.app.routes):
        regex = getattr(route, "path_regex", None)
        if regex is not None and route.methods and regex.match(request.url.path):
            methods |= route.methods
    return ", ".join(sorted(methods))


def _suggestion(param: str, value: object) -> str:
    """ " (did you mean 'x'?)" for a mistyped hyperparameter (an unknown key) or method type (a value)."""
    from service.suggest import did_you_mean
    from trainers.registry import METHODS

    parts = param.split(".")
    if len(parts) == 4 and parts[0] == "method" and parts[2] == "hyperparameters" and parts[1] in METHODS:
        return did_you_mean(parts[3], [p.name for p in METHODS[parts[1]].hyperparameters])
    if param == "method.type" and isinstance(value, str):
        return did_you_mean(value, METHODS)
    return ""


def install_error_handlers(app: FastAPI) -> None:
    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(AppError)
    async def _app_error(_request: Request, exc: AppError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = tuple(first.get("loc", ()))
        is_key = "[key]" in loc  # a dict key failed (a metadata key too long): name the dict, not the key
        if is_key:
            loc = loc[: loc.index("[key]") - 1]
        if loc[:1] == ("body",):
            loc = _drop_union_tags(loc, exc.body)
        # a header is named as declared (Last-Event-ID), not as a Python identifier
        param = str(loc[1]) if loc[:1] == ("header",) and len(loc) > 1 else _loc_to_param(loc)
        message = str(first.get("msg", "invalid request"))
        if first.get("type") == "extra_forbidden":
            message = f"unknown parameter '{param}'{_suggestion(param, None)}"
        elif param:
            hint = _suggestion(param, first.get("input"))
            message = f"{param}: {'a key: ' if is_key else ''}{message}{hint}"
        return BadRequest(message, param=param or None, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
        headers = {k.lower(): v for k, v in (exc.headers or {}).items()}
        if exc.status_code == 405:
            headers["allow"] = _allowed_methods(request) or headers.get("allow", "")
        return JSONResponse(body, status_code=exc.status_code, headers=headers)

    async def _db_unavailable(_request: Request, exc: Exception) -> JSONResponse:
        return ServiceUnavailable(
            f"The database is unavailable ({type(exc).__name__}); retry in a few seconds.",
            code="database_unavailable",
        ).response()

    for error_type in DB_UNAVAILABLE_ERRORS:
        app.add_exception_handler(error_type, _db_unavailable)
