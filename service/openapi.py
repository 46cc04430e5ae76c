"""The OpenAPI document says what the API really answers.

FastAPI documents a 422 for every operation with parameters; this API turns validation errors into
400s in OpenAI's envelope (service.errors) and never answers 422, so those entries and their schemas
are dropped. The statuses it does answer are declared on the routers with `error_responses`.

An optional query or header parameter is absent or a string: it cannot be JSON `null`. FastAPI writes
`str | None` as `anyOf: [string, null]`, which tells a client (and Schemathesis) that a literal null is
valid; the null branch is dropped, leaving the parameter optional. And no parameter may hold a NUL
(service.dependencies.reject_unsafe_url answers 400), which a string parameter without a pattern of
its own now says; nor may any string of a JSON request body (service.middleware, service.input_guard:
a `stop` sequence, a metadata value, ...), which every string of a request body's schemas says too.

The graders' size caps and a generation's token limit are settings (service/graders/limits.py,
service/inference/service.py): the document states the values this server runs with (maxLength of a
sample and of a template, maxProperties of a multi's graders, the maximum of `max_tokens`), and offers
the `python` grader only where the operator enabled it (TUNEHOUSE_ALLOW_PYTHON_GRADER).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from service.config import get_settings

NO_NUL = "^[^\\u0000]*$"


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
        for body_schema in _request_body_schemas(schema):
            _strings_without_nul(body_schema)
        _grader_limits(schemas)
        _token_limits(schemas)
        if not get_settings().allow_python_grader:
            _without_python_graders(schema)
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
        schema["pattern"] = NO_NUL


def _refs(node: Any) -> set[str]:
    """The component names `node` refers to ($ref), at any depth."""
    if isinstance(node, dict):
        found = {node["$ref"].rsplit("/", 1)[-1]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def _request_body_schemas(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON request bodies' schemas: inline ones and every component they reach."""
    components = schema.get("components", {}).get("schemas", {})
    inline: list[dict[str, Any]] = []
    names: set[str] = set()
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
            if "schema" in body:
                inline.append(body["schema"])
                names |= _refs(body["schema"])
    pending = list(names)
    while pending:
        for name in _refs(components.get(pending.pop(), {})) - names:
            names.add(name)
            pending.append(name)
    return inline + [components[n] for n in sorted(names) if n in components]


def _strings_without_nul(node: Any) -> None:
    """Every free-text string of `node` says it holds no NUL (an enum, a const, a pattern of its own or
    a binary format already says more)."""
    if isinstance(node, dict):
        if node.get("type") == "string" and not {"pattern", "enum", "const", "format"} & set(node):
            node["pattern"] = NO_NUL
        for value in node.values():
            _strings_without_nul(value)
    elif isinstance(node, list):
        for value in node:
            _strings_without_nul(value)


def _grader_limits(schemas: dict[str, Any]) -> None:
    settings = get_settings()
    for name in ("StringCheckGrader", "TextSimilarityGrader"):
        for field in ("input", "reference"):
            if field in schemas.get(name, {}).get("properties", {}):
                schemas[name]["properties"][field]["maxLength"] = settings.grader_max_text_chars
    if "model_sample" in schemas.get("GraderRunRequest", {}).get("properties", {}):
        schemas["GraderRunRequest"]["properties"]["model_sample"]["maxLength"] = (
            settings.grader_max_text_chars
        )
    if "graders" in schemas.get("MultiGrader", {}).get("properties", {}):
        schemas["MultiGrader"]["properties"]["graders"]["maxProperties"] = settings.grader_max_sub_graders


def _token_limits(schemas: dict[str, Any]) -> None:
    """A generation's token limit (service/inference/service.py refuses more): this server's value."""
    most = get_settings().inference_max_tokens
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        for field in ("max_tokens", "max_completion_tokens"):
            for branch in schemas.get(name, {}).get("properties", {}).get(field, {}).get("anyOf", []):
                if branch.get("type") == "integer":
                    branch["maximum"] = most


def _without_python_graders(node: Any) -> None:
    """Drop the `python` branch of every grader union (and its discriminator mapping): this server
    refuses python graders (400 `python_grader_disabled`)."""
    python = "#/components/schemas/PythonGrader"
    if isinstance(node, dict):
        if isinstance(node.get("oneOf"), list):
            node["oneOf"] = [branch for branch in node["oneOf"] if branch.get("$ref") != python]
        node.get("discriminator", {}).get("mapping", {}).pop("python", None)
        for value in node.values():
            _without_python_graders(value)
    elif isinstance(node, list):
        for value in node:
            _without_python_graders(value)
    if isinstance(node, dict) and isinstance(node.get("components"), dict):
        node["components"].get("schemas", {}).pop("PythonGrader", None)
