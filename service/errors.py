"""One error hierarchy, rendered by one handler as OpenAI's envelope:
`{"error": {"message", "type", "param", "code"}}`.

    AppError
     ├── BadRequest            400 invalid_request_error
     ├── Unauthorized          401 authentication_error
     ├── NotFound              404 invalid_request_error (also another tenant's object)
     ├── Conflict              409 invalid_request_error (e.g. cancelling a finished job)
     ├── PayloadTooLarge       413 invalid_request_error
     └── NotImplementedYet     501 not_implemented
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


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


class BadRequest(AppError):
    status_code = 400
    type = "invalid_request_error"


class Unauthorized(AppError):
    status_code = 401
    type = "authentication_error"


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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(AppError)
    async def _app_error(_request: Request, exc: AppError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = _loc_to_param(tuple(first.get("loc", ())))
        message = str(first.get("msg", "invalid request"))
        if first.get("type") == "extra_forbidden":
            message = f"unknown parameter '{param}'"
        elif param:
            message = f"{param}: {message}"
        err = BadRequest(message, param=param or None, code="invalid_value")
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, _exc: Exception) -> JSONResponse:
        body = {
            "error": {"message": "internal server error", "type": "server_error", "param": None, "code": None}
        }
        return JSONResponse(body, status_code=500)
