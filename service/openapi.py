"""The OpenAPI document says what the API really answers.

FastAPI documents a 422 for every operation with parameters; this API turns validation errors into
400s in OpenAI's envelope (service.errors) and never answers 422, so those entries and their schemas
are dropped. The statuses it does answer are declared on the routers with `error_responses`.

An optional query or header parameter is absent or a string: it cannot be JSON `null`. FastAPI writes
`str | None` as `anyOf: [string, null]`, which tells a client (and Schemathesis) that a literal null is
valid; the null branch is dropped, leaving the parameter optional. And no parameter may hold a NUL
(service.dependencies.reject_unsafe_url answers 400), which a string parameter without a pattern of
its own now says.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi


def install_openapi(app: FastAPI) -> None:
    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
                for parameter in operation.get("parameters", []):
                    _drop_null(parameter)
                    _no_nul(parameter)
        schemas = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = schema
        return schema

    app.openapi = build  # type: ignore[method-assign]


def _drop_null(parameter: dict[str, Any]) -> None:
    schema = parameter.get("schema", {})
    branches = schema.get("anyOf")
    if not branches:
        return
    kept = [b for b in branches if b.get("type") != "null"]
    if len(kept) == 1 and len(kept) < len(branches):
        del schema["anyOf"]
        schema.update(kept[0])


def _no_nul(parameter: dict[str, Any]) -> None:
    schema = parameter.get("schema", {})
    if schema.get("type") == "string" and "pattern" not in schema:
        schema["pattern"] = "^[^\\u0000]*$"
