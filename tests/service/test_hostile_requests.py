"""A corpus of hostile requests against a real uvicorn server on PostgreSQL.

Every case must be answered with a 4xx in OpenAI's error envelope that names the `param` (or the file
line) at fault, and must store nothing: no row of the tenant's, no blob, no temp file. The module prints
the tally (cases tried / 4xx / 5xx / stored) at the end (`pytest -s` shows it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.conftest import new_key
from tests.helpers import chat_rows, jsonl, stored_counts, tenant_of, upload_ok

MODEL = "tunehouse/tiny-llama"
BOUNDARY = "hostileboundary"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"
GOOD_LINE = json.dumps(chat_rows(1)[0])


@dataclass(frozen=True)
class Case:
    id: str
    method: str
    path: str  # "{file}", "{job}", "{done_job}" are filled in from the world fixture
    status: int = 400
    param: str | None = None  # error.param must equal this (when given)
    needle: str | None = None  # error.message must contain this (when given)
    json_body: Any = None
    raw: bytes | None = None  # a body sent as is (JSON the json module would not write, multipart)
    content_type: str | None = None
    params: dict[str, str] | None = None
    headers: dict[str, str | bytes] = field(default_factory=dict)
    auth: bool = True  # False: sent without the tenant's key (with `headers` only)
    check: Callable[[httpx.Response], None] | None = None


def _job(hp: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "training_file": "{file}"}
    if hp is not None:
        body["method"] = {"type": "supervised", "supervised": {"hyperparameters": hp}}
    return {**body, **extra}


HP = "method.supervised.hyperparameters"


def _raw_job(fragment: str) -> bytes:
    # JSON that json.dumps would never produce (1e999, a lone surrogate escape): written by hand
    return ('{"model": "' + MODEL + '", "training_file": "{file}", ' + fragment + "}").encode()


def _raw_hp(name: str, literal: str, method: str = "supervised") -> bytes:
    return _raw_job(
        f'"method": {{"type": "{method}", "{method}": {{"hyperparameters": {{"{name}": {literal}}}}}}}'
    )


def _part(
    name: str, value: bytes, *, filename: str | None = None, raw_disposition: bytes | None = None
) -> bytes:
    disposition = (
        raw_disposition
        or (
            f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        ).encode()
    )
    return (
        b"--" + BOUNDARY.encode() + b"\r\nContent-Disposition: " + disposition + b"\r\n\r\n" + value + b"\r\n"
    )


def _multipart(*parts: bytes, close: bool = True) -> bytes:
    return b"".join(parts) + (b"--" + BOUNDARY.encode() + b"--\r\n" if close else b"")


def _upload(data: bytes, *extra: bytes) -> bytes:
    return _multipart(_part("purpose", b"fine-tune"), _part("file", data, filename="t.jsonl"), *extra)


def _allow(expected: set[str]) -> Callable[[httpx.Response], None]:
    def check(response: httpx.Response) -> None:
        assert {m.strip() for m in response.headers["allow"].split(",")} == expected

    return check


NUL = "\x00"
JOB_PATHS = ["", "/cancel", "/pause", "/resume", "/events", "/checkpoints", "/stream", "/metrics"]

CASES: list[Case] = [
    # --- a NUL in any path id (PostgreSQL refuses NUL in text: it was a 500) -------------------------
    Case("nul-file-get", "GET", "/v1/files/file-%00x", param="file_id", needle="NUL"),
    Case("nul-file-delete", "DELETE", "/v1/files/%00", param="file_id"),
    Case("nul-file-content", "GET", "/v1/files/a%00b/content", param="file_id"),
    *[
        Case(
            f"nul-job{p.replace('/', '-') or '-get'}",
            "POST" if p in ("/cancel", "/pause", "/resume") else "GET",
            f"/v1/fine_tuning/jobs/ftjob-%00{p}",
            param="job_id",
        )
        for p in JOB_PATHS
    ],
    Case(
        "nul-checkpoint-id",
        "GET",
        "/v1/fine_tuning/jobs/{job}/checkpoints/ck%00/content",
        param="checkpoint_id",
    ),
    Case("nul-model-id", "GET", "/v1/models/tiny%00", param="model_id"),
    # --- a NUL in a query parameter's value or name -------------------------------------------------------
    Case("nul-files-after", "GET", "/v1/files", params={"after": NUL}, param="after"),
    Case("nul-files-purpose", "GET", "/v1/files", params={"purpose": f"fine{NUL}"}, param="purpose"),
    Case("nul-jobs-after", "GET", "/v1/fine_tuning/jobs", params={"after": NUL}, param="after"),
    Case(
        "nul-jobs-metadata", "GET", "/v1/fine_tuning/jobs", params={"metadata[k]": NUL}, param="metadata[k]"
    ),
    Case(
        "nul-events-after", "GET", "/v1/fine_tuning/jobs/{job}/events", params={"after": NUL}, param="after"
    ),
    Case(
        "nul-ckpt-after",
        "GET",
        "/v1/fine_tuning/jobs/{job}/checkpoints",
        params={"after": NUL},
        param="after",
    ),
    Case("nul-param-name", "GET", "/v1/files", params={f"x{NUL}": "1"}, param=f"x{NUL}"),
    # --- a NUL or a lone surrogate in a JSON string ------------------------------------------------------
    Case("nul-json-model", "POST", "/v1/fine_tuning/jobs", json_body=_job(model=f"m{NUL}"), param="model"),
    Case(
        "nul-json-file",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job(training_file=f"file-{NUL}"),
        param="training_file",
    ),
    Case("nul-json-suffix", "POST", "/v1/fine_tuning/jobs", json_body=_job(suffix=f"a{NUL}"), param="suffix"),
    Case(
        "nul-json-metadata-value",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job(metadata={"k": f"v{NUL}"}),
        param="metadata.k",
    ),
    Case(
        "nul-json-metadata-key",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job(metadata={f"k{NUL}": "v"}),
        needle="parameter name",
    ),
    Case(
        "surrogate-json-suffix",
        "POST",
        "/v1/fine_tuning/jobs",
        raw=_raw_job('"suffix": "a\\ud800"'),
        param="suffix",
        needle="surrogate",
    ),
    Case(
        "surrogate-json-metadata",
        "POST",
        "/v1/fine_tuning/jobs",
        raw=_raw_job('"metadata": {"k": "\\udfff"}'),
        param="metadata.k",
    ),
    # --- non-finite numbers anywhere in the body ------------------------------------------------------------
    Case(
        "nan-multiplier",
        "POST",
        "/v1/fine_tuning/jobs",
        raw=_raw_hp("learning_rate_multiplier", "NaN"),
        param=f"{HP}.learning_rate_multiplier",
        needle="finite",
    ),
    Case(
        "infinity-lr",
        "POST",
        "/v1/fine_tuning/jobs",
        raw=_raw_hp("learning_rate", "Infinity"),
        param=f"{HP}.learning_rate",
    ),
    Case(
        "neg-infinity-warmup",
        "POST",
        "/v1/fine_tuning/jobs",
        raw=_raw_hp("warmup_ratio", "-Infinity"),
        param=f"{HP}.warmup_ratio",
    ),
    Case(
        "1e999-weight-decay",
        "POST",
        "/v1/fine_tuning/jobs",
        raw=_raw_hp("weight_decay", "1e999"),
        param=f"{HP}.weight_decay",
    ),
    Case(
        "nan-legacy-hp",
        "POST",
        "/v1/fine_tuning/jobs",
        raw=_raw_job('"hyperparameters": {"n_epochs": NaN}'),
        param="hyperparameters.n_epochs",
    ),
    Case(
        "nan-unknown-field",
        "POST",
        "/v1/fine_tuning/jobs",
        raw=_raw_job('"whatever": [1, NaN]'),
        param="whatever[1]",
    ),
    Case(
        "nan-metadata",
        "POST",
        "/v1/fine_tuning/jobs",
        raw=_raw_job('"metadata": {"k": NaN}'),
        param="metadata.k",
    ),
    Case(
        "nan-in-grader",
        "POST",
        "/v1/fine_tuning/jobs",
        raw=_raw_job(
            '"method": {"type": "grpo", "grpo": {"grader": {"type": "multi", "weights": {"a": NaN}}}}'
        ),
        param="method.grpo.grader.weights.a",
    ),
    Case(
        "nan-ppo-kl",
        "POST",
        "/v1/fine_tuning/jobs",
        raw=_raw_hp("kl_coef", "-1e400", "ppo"),
        param="method.ppo.hyperparameters.kl_coef",
    ),
    # --- integers beyond any column, in bodies, cursors and Last-Event-ID ---------------------------------
    Case("seed-1e20", "POST", "/v1/fine_tuning/jobs", json_body=_job(seed=10**20), param="seed"),
    Case(
        "max-steps-1e30-int",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job({"max_steps": 10**30}),
        param=f"{HP}.max_steps",
    ),
    Case(
        "max-steps-2e31",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job({"max_steps": 2**31}),
        param=f"{HP}.max_steps",
    ),
    Case(
        "huge-int-literal",
        "POST",
        "/v1/fine_tuning/jobs",
        raw=_raw_job('"seed": 1' + "0" * 5000),
        needle="JSON",
    ),
    Case(
        "metrics-after-1e20",
        "GET",
        "/v1/fine_tuning/jobs/{job}/metrics",
        params={"after": str(10**20)},
        param="after",
    ),
    Case(
        "metrics-after-negative",
        "GET",
        "/v1/fine_tuning/jobs/{job}/metrics",
        params={"after": "-1"},
        param="after",
    ),
    Case(
        "metrics-after-text",
        "GET",
        "/v1/fine_tuning/jobs/{job}/metrics",
        params={"after": "ten"},
        param="after",
    ),
    Case(
        "last-event-id-overflow",
        "GET",
        "/v1/fine_tuning/jobs/{job}/stream",
        headers={"Last-Event-ID": "e99999999999999999999.m1"},
        param="Last-Event-ID",
    ),
    Case(
        "last-event-id-step-overflow",
        "GET",
        "/v1/fine_tuning/jobs/{job}/stream",
        headers={"Last-Event-ID": "e1.m4294967296"},
        param="Last-Event-ID",
    ),
    Case(
        "last-event-id-garbage",
        "GET",
        "/v1/fine_tuning/jobs/{job}/stream",
        headers={"Last-Event-ID": "'; DROP TABLE jobs; --"},
        param="Last-Event-ID",
    ),
    Case("files-limit-1e20", "GET", "/v1/files", params={"limit": str(10**20)}, param="limit"),
    Case("jobs-limit-zero", "GET", "/v1/fine_tuning/jobs", params={"limit": "0"}, param="limit"),
    Case(
        "events-limit-negative",
        "GET",
        "/v1/fine_tuning/jobs/{job}/events",
        params={"limit": "-5"},
        param="limit",
    ),
    Case("files-order-sideways", "GET", "/v1/files", params={"order": "sideways"}, param="order"),
    # --- ints are ints and bools are bools (no lax coercion), within bounds --------------------------------
    Case(
        "max-steps-1e30-float",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job({"max_steps": 1e30}),
        param=f"{HP}.max_steps",
    ),
    Case(
        "n-epochs-true",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job({"n_epochs": True}),
        param=f"{HP}.n_epochs",
    ),
    Case(
        "n-epochs-2.5",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job({"n_epochs": 2.5}),
        param=f"{HP}.n_epochs",
    ),
    Case(
        "batch-size-string",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job({"batch_size": "8"}),
        param=f"{HP}.batch_size",
    ),
    Case("lora-int", "POST", "/v1/fine_tuning/jobs", json_body=_job({"lora": 1}), param=f"{HP}.lora"),
    Case("seed-true", "POST", "/v1/fine_tuning/jobs", json_body=_job(seed=True), param="seed"),
    Case(
        "legacy-n-epochs-false",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job(hyperparameters={"n_epochs": False}),
        param="hyperparameters.n_epochs",
    ),
    Case(
        "n-epochs-1000",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job({"n_epochs": 1000}),
        param=f"{HP}.n_epochs",
    ),
    # --- metadata: OpenAI's limits ------------------------------------------------------------------------
    Case(
        "metadata-17-pairs",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job(metadata={f"k{i}": "v" for i in range(17)}),
        param="metadata",
    ),
    Case(
        "metadata-key-65",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job(metadata={"k" * 65: "v"}),
        param="metadata",
    ),
    Case(
        "metadata-key-64k",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job(metadata={"k" * 65536: "v"}),
        param="metadata",
    ),
    Case(
        "metadata-value-513",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job(metadata={"k": "v" * 513}),
        param="metadata.k",
    ),
    Case(
        "metadata-value-number",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job(metadata={"k": 1}),
        param="metadata.k",
    ),
    Case("metadata-list", "POST", "/v1/fine_tuning/jobs", json_body=_job(metadata=["a"]), param="metadata"),
    # --- request bodies: size, syntax, shape -----------------------------------------------------------
    Case(
        "json-body-10mib",
        "POST",
        "/v1/fine_tuning/jobs",
        raw=_raw_job('"suffix": "' + "a" * (10 * 1024 * 1024) + '"'),
        status=413,
        needle="limit",
    ),
    Case("json-body-2mib-no-length", "POST", "/v1/fine_tuning/jobs", raw=b"CHUNKED", status=413),
    Case("json-body-invalid", "POST", "/v1/fine_tuning/jobs", raw=b'{"model": ', needle="not valid JSON"),
    Case(
        "json-body-latin1",
        "POST",
        "/v1/fine_tuning/jobs",
        raw='{"model": "caf\xe9"}'.encode("latin-1"),
        needle="not valid JSON",
    ),
    Case("json-body-nested-100k", "POST", "/v1/fine_tuning/jobs", raw=b"[" * 100_000 + b"]" * 100_000),
    Case("json-body-array", "POST", "/v1/fine_tuning/jobs", json_body=[_job()]),
    Case(
        "json-unknown-field",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job(temperature=2),
        param="temperature",
    ),
    Case(
        "json-method-type",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job(method={"type": "magic"}),
        param="method.type",
    ),
    Case(
        "json-cancel-body-too-large",
        "POST",
        "/v1/fine_tuning/jobs/{job}/cancel",
        raw=b"x" * (2 * 1024 * 1024),
        content_type="application/octet-stream",
        status=413,
    ),
    # --- multipart uploads that cannot be parsed or must not be stored ---------------------------------
    Case(
        "mp-oversized-part-header",
        "POST",
        "/v1/files",
        param="file",
        needle="multipart",
        raw=_multipart(
            _part(
                "file",
                jsonl(chat_rows(1)),
                raw_disposition=b'form-data; name="file"; filename="' + b"a" * 8000 + b'.jsonl"',
            )
        ),
    ),
    Case(
        "mp-cr-in-filename",
        "POST",
        "/v1/files",
        param="file",
        needle="multipart",
        raw=_multipart(
            _part(
                "file", jsonl(chat_rows(1)), raw_disposition=b'form-data; name="file"; filename="a\rb.jsonl"'
            )
        ),
    ),
    Case(
        "mp-garbage-after-boundary",
        "POST",
        "/v1/files",
        param="file",
        needle="multipart",
        raw=b"--" + BOUNDARY.encode() + b"GARBAGE\r\n" + _upload(jsonl(chat_rows(1))),
    ),
    Case(
        "mp-no-closing-boundary",
        "POST",
        "/v1/files",
        param="file",
        needle="closing boundary",
        raw=_multipart(
            _part("purpose", b"fine-tune"),
            _part("file", jsonl(chat_rows(2)), filename="t.jsonl"),
            close=False,
        ),
    ),
    Case(
        "mp-truncated-mid-file",
        "POST",
        "/v1/files",
        param="file",
        needle="closing boundary",
        raw=_multipart(_part("purpose", b"fine-tune"), close=False)
        + b"--"
        + BOUNDARY.encode()
        + b'\r\nContent-Disposition: form-data; name="file"; filename="t.jsonl"\r\n\r\n'
        + jsonl(chat_rows(3)),
    ),
    Case(
        "mp-5000-fields",
        "POST",
        "/v1/files",
        param="file",
        needle="parts",
        raw=_multipart(
            *[_part(f"f{i}", b"x") for i in range(5000)], _part("file", b"{}", filename="t.jsonl")
        ),
    ),
    Case(
        "mp-boundary-71",
        "POST",
        "/v1/files",
        param="file",
        needle="boundary is longer than 70",
        content_type="multipart/form-data; boundary=" + "b" * 71,
        raw=_upload(jsonl(chat_rows(1))).replace(BOUNDARY.encode(), b"b" * 71),
    ),
    Case(
        "mp-9-header-lines",
        "POST",
        "/v1/files",
        param="file",
        needle="more than 8 header lines",
        raw=_multipart(
            _part("purpose", b"fine-tune"),
            _part(
                "file",
                jsonl(chat_rows(1)),
                raw_disposition=b'form-data; name="file"; filename="t.jsonl"'
                + b"".join(b"\r\nX-H%d: v" % i for i in range(8)),
            ),
        ),
    ),
    Case(
        "mp-field-too-long",
        "POST",
        "/v1/files",
        param="purpose",
        raw=_multipart(
            _part("purpose", b"x" * 10_000), _part("file", jsonl(chat_rows(1)), filename="t.jsonl")
        ),
    ),
    Case(
        "mp-two-files",
        "POST",
        "/v1/files",
        param="file",
        raw=_upload(jsonl(chat_rows(1)), _part("file", jsonl(chat_rows(1)), filename="u.jsonl")),
    ),
    Case(
        "mp-control-char-filename",
        "POST",
        "/v1/files",
        param="file",
        needle="control character",
        raw=_multipart(
            _part("purpose", b"fine-tune"),
            _part(
                "file",
                jsonl(chat_rows(1)),
                raw_disposition=b'form-data; name="file"; filename="a\x01b.jsonl"',
            ),
        ),
    ),
    Case(
        "mp-filename-600-chars",
        "POST",
        "/v1/files",
        param="file",
        needle="longer",
        raw=_multipart(
            _part("purpose", b"fine-tune"), _part("file", jsonl(chat_rows(1)), filename="n" * 600)
        ),
    ),
    Case(
        "mp-boundary-too-long",
        "POST",
        "/v1/files",
        param="file",
        content_type="multipart/form-data; boundary=" + "b" * 300,
        raw=b"--" + b"b" * 300 + b"--\r\n",
    ),
    Case(
        "mp-no-boundary",
        "POST",
        "/v1/files",
        param="file",
        content_type="multipart/form-data",
        raw=_upload(jsonl(chat_rows(1))),
    ),
    Case("mp-json-instead", "POST", "/v1/files", param="file", content_type="application/json", raw=b"{}"),
    Case(
        "mp-purpose-missing",
        "POST",
        "/v1/files",
        param="purpose",
        raw=_multipart(_part("file", jsonl(chat_rows(1)), filename="t.jsonl")),
    ),
    Case(
        "mp-purpose-nul",
        "POST",
        "/v1/files",
        param="purpose",
        raw=_multipart(
            _part("purpose", b"fine-tune\x00"), _part("file", jsonl(chat_rows(1)), filename="t.jsonl")
        ),
    ),
    Case("mp-empty-body", "POST", "/v1/files", param="file", raw=b""),
    # --- file contents: rejected at upload, naming the line ----------------------------------------------
    Case(
        "file-lone-surrogate",
        "POST",
        "/v1/files",
        param="file",
        needle="line 2",
        raw=_upload(
            f'{GOOD_LINE}\n{{"messages": [{{"role": "user", "content": "hi \\ud800"}}, '
            f'{{"role": "assistant", "content": "x"}}]}}\n'.encode()
        ),
    ),
    Case(
        "file-nul-escape",
        "POST",
        "/v1/files",
        param="file",
        needle="line 1",
        raw=_upload(b'{"text": "a\\u0000b"}\n'),
    ),
    Case(
        "file-1e999",
        "POST",
        "/v1/files",
        param="file",
        needle="line 2",
        raw=_upload(f'{GOOD_LINE}\n{{"prompt": "a", "completion": "b", "score": 1e999}}\n'.encode()),
    ),
    Case("file-nan", "POST", "/v1/files", param="file", needle="line 1", raw=_upload(b'{"text": NaN}\n')),
    # --- authentication ------------------------------------------------------------------------------------
    Case("auth-missing", "GET", "/v1/files", status=401, auth=False),
    Case(
        "auth-basic",
        "GET",
        "/v1/files",
        status=401,
        auth=False,
        headers={"Authorization": "Basic dXNlcjpwdw=="},
    ),
    Case(
        "auth-wrong-secret",
        "GET",
        "/v1/files",
        status=401,
        auth=False,
        headers={"Authorization": "Bearer th-0123456789abcdef-not-the-secret"},
    ),
    Case(
        "auth-latin1-key",
        "GET",
        "/v1/files",
        status=401,
        auth=False,
        headers={"Authorization": b"Bearer th-\xe9\xe9-x"},
    ),
    Case(
        "auth-huge-key",
        "GET",
        "/v1/files",
        status=401,
        auth=False,
        headers={"Authorization": "Bearer th-" + "a" * 6000},
    ),
    # --- methods, routes and states -----------------------------------------------------------------------
    Case("put-files-405", "PUT", "/v1/files", status=405, check=_allow({"GET", "POST"})),
    Case("patch-job-405", "PATCH", "/v1/fine_tuning/jobs/{job}", status=405, check=_allow({"GET"})),
    Case("delete-jobs-405", "DELETE", "/v1/fine_tuning/jobs", status=405, check=_allow({"GET", "POST"})),
    # `estimate` is the collection's own path, not a job id (OpenAPI: concrete before templated paths)
    Case("get-estimate-405", "GET", "/v1/fine_tuning/jobs/estimate", status=405, check=_allow({"POST"})),
    Case(
        "options-estimate-405", "OPTIONS", "/v1/fine_tuning/jobs/estimate", status=405, check=_allow({"POST"})
    ),
    Case("unknown-route", "GET", "/v1/assistants", status=404),
    Case(
        "cancel-cancelled-409",
        "POST",
        "/v1/fine_tuning/jobs/{done_job}/cancel",
        status=409,
        param="fine_tuning_job_id",
    ),
    Case(
        "other-tenants-file",
        "POST",
        "/v1/fine_tuning/jobs",
        json_body=_job(training_file="{other_file}"),
        param="training_file",
    ),
    # --- webhooks -------------------------------------------------------------------------------------------
    Case("webhook-nul-url", "POST", "/v1/webhooks", raw=b'{"url": "http://h/\\u0000"}', param="url"),
    Case(
        "webhook-javascript-url",
        "POST",
        "/v1/webhooks",
        json_body={"url": "javascript:alert(1)"},
        param="url",
    ),
    Case(
        "webhook-events-not-strings",
        "POST",
        "/v1/webhooks",
        json_body={"url": "http://h/", "events": [{"type": "fine_tuning.job.queued"}]},
        param="events[0]",
    ),
    Case(
        "webhook-events-too-many",
        "POST",
        "/v1/webhooks",
        json_body={"url": "http://h/", "events": ["fine_tuning.job.queued"] * 100},
        param="events",
    ),
    Case(
        "webhook-description-huge",
        "POST",
        "/v1/webhooks",
        json_body={"url": "http://h/", "description": "d" * 600},
        param="description",
    ),
    Case(
        "webhook-deliveries-bad-status",
        "GET",
        "/v1/webhooks/wh-x/deliveries",
        params={"status": "lost"},
        param="status",
    ),
    Case("put-webhook-405", "PUT", "/v1/webhooks", status=405, check=_allow({"GET", "POST"})),
]


@dataclass
class World:
    client: httpx.Client
    anonymous: httpx.Client
    tenant_id: str
    ids: dict[str, str]


TALLY: dict[str, int] = {"tried": 0, "4xx": 0, "5xx": 0, "stored": 0}


@pytest.fixture(scope="module")
def world(api_url: str) -> Iterator[World]:
    key = new_key()
    other = httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {new_key()}"}, timeout=60)
    with (
        httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client,
        httpx.Client(base_url=api_url, timeout=60) as anonymous,
    ):
        file_id = upload_ok(client, chat_rows(16))
        jobs = [
            client.post("/v1/fine_tuning/jobs", json={"model": MODEL, "training_file": file_id})
            for _ in (0, 1)
        ]
        job_ids = [j.json()["id"] for j in jobs]
        assert client.post(f"/v1/fine_tuning/jobs/{job_ids[1]}/cancel").status_code == 200
        ids = {
            "file": file_id,
            "job": job_ids[0],
            "done_job": job_ids[1],
            "other_file": upload_ok(other, chat_rows(2)),
        }
        other.close()
        yield World(client=client, anonymous=anonymous, tenant_id=tenant_of(key), ids=ids)
    print(
        f"\nhostile corpus: {TALLY['tried']} cases tried, {TALLY['4xx']} answered 4xx, "
        f"{TALLY['5xx']} answered 5xx, {TALLY['stored']} stored something"
    )


def _fill(text: str, ids: dict[str, str]) -> str:
    for name, value in ids.items():
        text = text.replace("{" + name + "}", value)
    return text


def _send(world: World, case: Case) -> httpx.Response:
    headers = dict(case.headers)
    content: Any = None
    if case.raw == b"CHUNKED":
        # 2 MiB in chunks and no Content-Length: the limit must hold while the body streams in
        content = iter([b'{"suffix": "' + b"a" * (256 * 1024)] * 8 + [b'"}'])
        headers["content-type"] = "application/json"
    elif case.raw is not None:
        content = _fill(case.raw.decode("latin-1"), world.ids).encode("latin-1")
        if case.path == "/v1/files":
            headers["content-type"] = case.content_type or MULTIPART
        else:
            headers["content-type"] = case.content_type or "application/json"
    elif case.json_body is not None:
        content = _fill(json.dumps(case.json_body), world.ids).encode()
        headers["content-type"] = "application/json"
    client = world.client if case.auth else world.anonymous
    return client.request(
        case.method, _fill(case.path, world.ids), params=case.params, content=content, headers=headers
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_request_is_a_4xx_and_stores_nothing(world: World, case: Case) -> None:
    before = stored_counts(world.tenant_id)
    response = _send(world, case)
    after = stored_counts(world.tenant_id)
    TALLY["tried"] += 1
    TALLY["4xx"] += 400 <= response.status_code < 500
    TALLY["5xx"] += response.status_code >= 500
    TALLY["stored"] += after != before

    assert response.status_code == case.status, response.text[:500]
    assert after == before, (before, after)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if case.param is not None:
        assert error["param"] == case.param, error
    if case.needle is not None:
        assert case.needle in error["message"], error
    assert response.headers["x-request-id"].startswith("req_")
    if case.check is not None:
        case.check(response)


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)
