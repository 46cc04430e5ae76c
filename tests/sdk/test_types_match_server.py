"""The SDK's types against the server's OpenAPI document (the live `/openapi.json`): every field of an SDK
model exists in the server's schema of the answer it reads, with a type the SDK accepts (and present
whenever the SDK requires it); every `Literal` (job status, error fault, object names, ...) has exactly the
server's enum values; every request the SDK builds goes to an operation the server declares, with query
parameters, body fields and headers the server knows, and the server's required body fields are the
SDK's required arguments.

Some answers are not described by the server's schema (its list endpoints answer untyped objects, and an
SSE stream has no schema): they are named below, and this test fails once the server describes one of
them, so that it is checked from then on."""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

import tunehouse.types as sdk_types
from tunehouse._base_client import APIRequest
from tunehouse._download import Download
from tunehouse._pagination import PageRequest
from tunehouse._resource import _Method
from tunehouse._streaming import EventStream
from tunehouse.resources.chat import ChatStream, _Completions
from tunehouse.resources.files import _Files
from tunehouse.resources.jobs import _Checkpoints, _Jobs
from tunehouse.resources.models import _Models
from tunehouse.resources.webhooks import _Webhooks

Schema = dict[str, Any]

# SDK model -> the answer it reads: (method, path, whether it is one item of that list answer)
ANSWERS: dict[type[BaseModel], tuple[str, str, bool]] = {
    sdk_types.FileObject: ("post", "/v1/files", False),
    sdk_types.FileDeleted: ("delete", "/v1/files/{file_id}", False),
    sdk_types.FineTuningJob: ("get", "/v1/fine_tuning/jobs/{job_id}", False),
    sdk_types.JobEstimate: ("post", "/v1/fine_tuning/jobs/estimate", False),
    sdk_types.WebhookEndpoint: ("post", "/v1/webhooks", False),
    sdk_types.WebhookEndpointDeleted: ("delete", "/v1/webhooks/{webhook_id}", False),
    sdk_types.JobEvent: ("get", "/v1/fine_tuning/jobs/{job_id}/events", True),
    sdk_types.Checkpoint: ("get", "/v1/fine_tuning/jobs/{job_id}/checkpoints", True),
    sdk_types.MetricRow: ("get", "/v1/fine_tuning/jobs/{job_id}/metrics", True),
    sdk_types.WebhookDelivery: ("get", "/v1/webhooks/{webhook_id}/deliveries", True),
    sdk_types.Model: ("get", "/v1/models/{model_id}", False),
    sdk_types.ModelDeleted: ("delete", "/v1/models/{model_id}", False),
}
# the server's list answers are `{"type": "object", "additionalProperties": true}`: their items unstated
UNSTATED = {sdk_types.JobEvent, sdk_types.Checkpoint, sdk_types.MetricRow, sdk_types.WebhookDelivery}
# checked as a field of another model: JobError in FineTuningJob.error, WebhookAttempt in WebhookDelivery
NESTED = {sdk_types.JobError, sdk_types.WebhookAttempt, sdk_types.ModelTrainable}
# items of the SSE stream (text/event-stream: OpenAPI has no schema for its events)
# and the chat completion answers, which service/inference states no schema of (JSON or an SSE stream)
NO_SCHEMA = {sdk_types.StreamEnd, sdk_types.ChatCompletion, sdk_types.ChatCompletionChunk}


@pytest.fixture(scope="module")
def openapi(api_url: str) -> Schema:
    document: Schema = httpx.get(f"{api_url}/openapi.json", timeout=30).json()
    return document


def _resolve(schema: Schema, root: Schema) -> Schema:
    while "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def _variants(schema: Schema, root: Schema) -> list[Schema]:
    """The alternatives of a union (`anyOf` / `oneOf`), each resolved; one for a plain schema."""
    schema = _resolve(schema, root)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return [v for sub in schema[key] for v in _variants(sub, root)]
    return [schema]


def _json_type(schema: Schema) -> str | None:
    if "type" in schema:
        return str(schema["type"])
    if "const" in schema:
        return {str: "string", bool: "boolean", int: "integer", float: "number"}[type(schema["const"])]
    if "properties" in schema:
        return "object"
    return None  # any JSON value


def _enum(schema: Schema) -> set[Any] | None:
    if "const" in schema:
        return {schema["const"]}
    return set(schema["enum"]) if "enum" in schema else None


def _check_value(sdk: Schema, sdk_root: Schema, server: Schema, server_root: Schema, where: str) -> None:
    """Every value the server's schema allows is accepted by the SDK's; the SDK's enums are the server's."""
    sdk_options = [v for v in _variants(sdk, sdk_root) if _json_type(v) != "null"]
    sdk_nullable = any(_json_type(v) == "null" for v in _variants(sdk, sdk_root))
    for theirs in _variants(server, server_root):
        kind = _json_type(theirs)
        if kind == "null":
            assert sdk_nullable, f"{where}: the server may send null, the SDK does not accept it"
            continue
        accepting = [
            ours
            for ours in sdk_options
            if _json_type(ours) in (None, kind) or (_json_type(ours) == "number" and kind == "integer")
        ]
        assert accepting, f"{where}: the server sends {kind}, the SDK accepts {sdk_options}"
        ours = accepting[0]
        if (our_enum := _enum(ours)) is not None:
            assert _enum(theirs) == our_enum, (
                f"{where}: the SDK's Literal {sorted(our_enum)} against the server's {_enum(theirs)}"
            )
        if kind == "object" and "properties" in ours:
            assert "properties" in theirs, f"{where}: the SDK reads a model, the server states none"
            _check_model(ours, sdk_root, theirs, server_root, where)
        if kind == "array" and "items" in ours and "items" in theirs:
            _check_value(ours["items"], sdk_root, theirs["items"], server_root, f"{where}[]")


def _check_model(sdk: Schema, sdk_root: Schema, server: Schema, server_root: Schema, where: str) -> None:
    theirs = server.get("properties", {})
    required = set(server.get("required", []))
    for name, ours in sdk["properties"].items():
        field = f"{where}.{name}"
        assert name in theirs, f"{field}: not in the server's schema (its fields: {sorted(theirs)})"
        if name in sdk.get("required", []):
            # a field with a default is always sent (pydantic serialises defaults)
            assert name in required or "default" in theirs[name], f"{field}: required by the SDK only"
        _check_value(ours, sdk_root, theirs[name], server_root, field)


def _answer_schema(openapi: Schema, method: str, path: str, item: bool) -> Schema | None:
    responses = openapi["paths"][path][method]["responses"]
    schema = _resolve(responses["200"]["content"]["application/json"]["schema"], openapi)
    if item:
        data = schema.get("properties", {}).get("data")
        if data is None:
            return None  # an untyped list answer
        schema = _resolve(data["items"], openapi)
    return schema


def test_every_sdk_model_is_accounted_for() -> None:
    models = {
        value
        for value in vars(sdk_types).values()
        if isinstance(value, type) and issubclass(value, BaseModel) and value.__module__ == sdk_types.__name__
    }
    models -= {sdk_types._Object, sdk_types._ChatAnswer}
    assert models == set(ANSWERS) | NESTED | NO_SCHEMA


@pytest.mark.parametrize("model", list(ANSWERS), ids=lambda m: m.__name__)
def test_sdk_model_matches_the_servers_schema(openapi: Schema, model: type[BaseModel]) -> None:
    method, path, item = ANSWERS[model]
    server = _answer_schema(openapi, method, path, item)
    if model in UNSTATED:
        assert server is None, f"the server now states {model.__name__}'s schema: remove it from UNSTATED"
        return
    assert server is not None
    ours = model.model_json_schema()
    _check_model(ours, ours, server, openapi, model.__name__)


def test_job_statuses_are_the_servers(openapi: Schema) -> None:
    server = _resolve(openapi["components"]["schemas"]["JobObject"]["properties"]["status"], openapi)
    assert set(typing.get_args(sdk_types.JobStatus)) == set(server["enum"])
    assert set(sdk_types.TERMINAL_STATUSES) < set(server["enum"])
    # a stream's end carries a job status too (the stream itself has no schema)
    assert typing.get_args(sdk_types.StreamEnd.model_fields["status"].annotation) == typing.get_args(
        sdk_types.JobStatus
    )


def test_the_comparison_catches_a_drift(openapi: Schema) -> None:
    """The checks above can fail: a status the server does not have, a field it does not send."""

    class Drifted(sdk_types.FineTuningJob):
        status: typing.Literal["queued", "running", "done"]  # type: ignore[assignment]

    server = _answer_schema(openapi, "get", "/v1/fine_tuning/jobs/{job_id}", False)
    assert server is not None
    ours = Drifted.model_json_schema()
    with pytest.raises(AssertionError, match="Literal"):
        _check_model(ours, ours, server, openapi, "Drifted")

    class Extra(sdk_types.FileObject):
        colour: str

    ours = Extra.model_json_schema()
    file_schema = _answer_schema(openapi, "post", "/v1/files", False)
    assert file_schema is not None
    with pytest.raises(AssertionError, match="colour"):
        _check_model(ours, ours, file_schema, openapi, "Extra")


# -- requests -----------------------------------------------------------------------------------

RESOURCES = {
    "files": _Files,
    "jobs": _Jobs,
    "checkpoints": _Checkpoints,
    "webhooks": _Webhooks,
    "models": _Models,
    "chat.completions": _Completions,
}
# a value for each parameter type of the resource methods, to build every request with every field set
SAMPLES: dict[str, Any] = {
    "str": "x",
    "str | None": "x",
    "int | None": 1,
    "float | None": 1.0,
    "dict[str, str] | None": {"k": "v"},
    "dict[str, Any] | None": {"k": 1},
    "list[dict[str, Any]] | None": [{"k": 1}],
    "list[str] | None": ["x"],
    "list[dict[str, Any]]": [{"role": "user", "content": "x"}],
    "FileInput": b"x",
    "str | Path": Path("unused.tar"),
    "Progress | None": None,
    "Callable[[StreamItem], None] | None": None,
}
# query parameters the server reads without declaring them (OpenAI's `?metadata[key]=value` filter)
UNDECLARED_QUERY = re.compile(r"^metadata\[.+\]$")
# headers the SDK may send whether or not an operation declares them
FREE_HEADERS = {"accept", "idempotency-key"}


def _requests(op: Any) -> Iterator[APIRequest[Any]]:
    if isinstance(op, APIRequest):
        yield op
    elif isinstance(op, PageRequest):
        yield op.request
        yield op.after("x").request
    elif isinstance(op, ChatStream):
        yield op.request
    elif isinstance(op, EventStream):
        yield op._request("e1.m1")
    elif isinstance(op, Download):
        yield APIRequest("GET", op.url, lambda r: r, timeout=op.timeout)
    else:
        raise AssertionError(f"an operation this test does not know: {op!r}")


def _built(resource: type, name: str) -> tuple[Any, inspect.Signature]:
    method = vars(resource)[name]
    sig = method.signature(is_async=False)
    args = []
    kwargs = {}
    for param in sig.parameters.values():
        value = SAMPLES[str(param.annotation)]
        if param.kind is param.KEYWORD_ONLY:
            kwargs[param.name] = value
        else:
            args.append(value)
    return method._build(None, *args, **kwargs), sig


def _operation(openapi: Schema, method: str, path: str) -> Schema:
    for template, operations in openapi["paths"].items():
        if re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", template), path) and method in operations:
            operation: Schema = operations[method]
            return operation
    raise AssertionError(f"{method.upper()} {path}: no such operation in the server's schema")


METHODS = [
    (resource, name)
    for resource, cls in RESOURCES.items()
    for name, value in vars(cls).items()
    if isinstance(value, _Method) and name != "wait"  # wait is a stream, then a retrieve: both below
]


@pytest.mark.parametrize(("resource", "name"), METHODS, ids=[f"{r}.{n}" for r, n in METHODS])
def test_sdk_requests_match_the_servers_operations(openapi: Schema, resource: str, name: str) -> None:
    op, sig = _built(RESOURCES[resource], name)
    for request in _requests(op):
        where = f"{resource}.{name}: {request.method} {request.path}"
        operation = _operation(openapi, request.method.lower(), request.path)
        declared = {(p["in"], p["name"].lower()) for p in operation.get("parameters", [])}
        for key in request.params or {}:
            assert ("query", key.lower()) in declared or UNDECLARED_QUERY.match(key), f"{where}: ?{key}"
        for key in request.headers:
            assert ("header", key.lower()) in declared or key.lower() in FREE_HEADERS, f"{where}: {key}"
        content = operation.get("requestBody", {}).get("content", {})
        if request.json is not None:
            body = _resolve(content["application/json"]["schema"], openapi)
            assert set(request.json) <= set(body["properties"]), where
            # what the server requires, the SDK requires too (a keyword without a default)
            required = {n for n, p in sig.parameters.items() if p.default is p.empty}
            assert set(body.get("required", [])) <= required, where
        if request.upload is not None or request.data is not None:
            form = _resolve(content["multipart/form-data"]["schema"], openapi)
            assert {"file", *(request.data or {})} <= set(form["properties"]), where
            for key, value in (request.data or {}).items():
                allowed = _enum(_resolve(form["properties"][key], openapi))
                default = sig.parameters[key].default
                assert allowed is None or default in allowed, f"{where}: {key}={value!r}"
