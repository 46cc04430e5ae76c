"""The OpenAPI document matches what the API does: checked by reading it, then by Schemathesis
(`--checks all`) against the live uvicorn server on PostgreSQL, with a fixed seed and example budget."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import new_key
from tests.helpers import chat_rows, upload_ok

CONFIG = Path(__file__).with_name("schemathesis.toml")
REAL_IDS = '\n[parameters]\n"path.file_id" = "${TH_FILE_ID}"\n"path.job_id" = "${TH_JOB_ID}"\n'

# examples per operation and phase: with the fixed seed the run is reproducible; ~530 requests, ~30 s
SCHEMATHESIS_EXAMPLES = 10
SCHEMATHESIS_SEED = 20261122


def _spec(api_url: str) -> dict[str, Any]:
    spec: dict[str, Any] = httpx.get(f"{api_url}/openapi.json").json()
    return spec


def test_document_lists_what_the_api_answers(api_url: str) -> None:
    spec = _spec(api_url)
    assert spec["components"]["securitySchemes"] == {
        "HTTPBearer": {
            "type": "http",
            "scheme": "bearer",
            "description": spec["components"]["securitySchemes"]["HTTPBearer"]["description"],
        }
    }
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            where = f"{method.upper()} {path}"
            statuses = set(op["responses"])
            assert "422" not in statuses, where  # validation errors are 400s here
            assert {"200", "400", "401", "503"} <= statuses, where
            for status in statuses - {"200"}:
                body = op["responses"][status]["content"]["application/json"]["schema"]
                assert body == error_ref, (where, status)
            assert "Retry-After" in op["responses"]["503"]["headers"], where
            assert op["security"] == [{"HTTPBearer": []}], where
            if "{" in path:
                assert "404" in statuses, where
    upload = spec["paths"]["/v1/files"]["post"]
    form = upload["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["required"] == ["file", "purpose"] and form["properties"]["file"]["format"] == "binary"
    assert (
        "413" in upload["responses"] and "413" in spec["paths"]["/v1/fine_tuning/jobs"]["post"]["responses"]
    )
    assert "409" in spec["paths"]["/v1/fine_tuning/jobs/{job_id}/cancel"]["post"]["responses"]
    assert not {"HTTPValidationError", "ValidationError"} & set(spec["components"]["schemas"])


def test_document_states_the_rules_the_server_enforces(api_url: str) -> None:
    """Issue 46: the server refused what the document allowed (a NUL in `stop`, a fifth stop sequence,
    an empty grader reference, an empty webhook url) and the graders' size caps were nowhere."""
    from service.config import get_settings

    spec = _spec(api_url)
    schemas = spec["components"]["schemas"]
    no_nul = "^[^\\u0000]*$"
    stop = schemas["ChatCompletionRequest"]["properties"]["stop"]["anyOf"]
    assert {"type": "string", "pattern": no_nul} in stop
    assert {"items": {"type": "string", "pattern": no_nul}, "type": "array", "maxItems": 4} in stop
    assert schemas["JobCreate"]["properties"]["model"]["pattern"] == no_nul
    settings = get_settings()
    for grader in ("StringCheckGrader", "TextSimilarityGrader"):
        reference = schemas[grader]["properties"]["reference"]
        assert (reference["minLength"], reference["maxLength"]) == (1, settings.grader_max_text_chars)
        assert schemas[grader]["properties"]["input"]["maxLength"] == settings.grader_max_text_chars
    assert schemas["MultiGrader"]["properties"]["graders"]["maxProperties"] == settings.grader_max_sub_graders
    sample = schemas["GraderRunRequest"]["properties"]["model_sample"]
    assert sample["maxLength"] == settings.grader_max_text_chars
    url = schemas["WebhookCreate"]["properties"]["url"]
    assert url["minLength"] >= 1 and re.match(url["pattern"], "https://example.com/hook")
    assert not re.match(url["pattern"], "ftp://example.com")
    header = spec["paths"]["/v1/fine_tuning/jobs"]["post"]["parameters"][0]
    assert (header["name"], header["in"]) == ("Idempotency-Key", "header")
    assert (header["schema"]["minLength"], header["schema"]["maxLength"]) == (1, 255)
    assert "409" in spec["paths"]["/v1/fine_tuning/jobs"]["post"]["responses"]
    # a response schema is left alone: it describes what the server sends
    assert "pattern" not in schemas["JobObject"]["properties"]["model"]


def test_schemathesis_finds_no_failure(api_url: str, tmp_path: Path) -> None:
    """`--checks all`: no 5xx, every status and body documented, schema-valid requests accepted and
    invalid ones rejected, auth enforced, 405 with Allow. Requests use a real file and job of the
    tenant (tests/service/schemathesis.toml says why each exception to the defaults is there)."""
    key = new_key()
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        file_id = upload_ok(client, chat_rows(8))
        job = client.post(
            "/v1/fine_tuning/jobs", json={"model": "tunehouse/tiny-llama", "training_file": file_id}
        )
        assert job.status_code == 200, job.text
    config = CONFIG.read_text()
    if os.environ.get("TUNEHOUSE_SCHEMATHESIS_FULL") == "1":
        config = config.replace("phases.coverage.enabled = false", "")
    env = {**os.environ, "NO_COLOR": "1", "TH_FILE_ID": file_id, "TH_JOB_ID": job.json()["id"]}
    generated = 0
    for name, extra, only in (
        ("generated-ids", "", []),
        # the generated-ids run already walked the stateful links; here the ids are fixed
        (
            "real-ids",
            REAL_IDS,
            ["--include-path-regex", r"\{(file|job)_id\}", "--phases", "coverage,fuzzing"],
        ),
    ):
        (tmp_path / f"{name}.toml").write_text(config + extra)
        command = [
            str(Path(sys.executable).with_name("schemathesis")),
            "--config-file",
            str(tmp_path / f"{name}.toml"),
            "run",
            f"{api_url}/openapi.json",
            *only,
            "--checks",
            "all",
            "--header",
            f"Authorization: Bearer {key}",
            "--seed",
            str(SCHEMATHESIS_SEED),
            "--max-examples",
            str(SCHEMATHESIS_EXAMPLES),
            "--generation-database",
            "none",
            "--no-color",
        ]
        run = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
        output = run.stdout + run.stderr
        tally = re.search(r"(\d+) generated, (\d+) passed", output)
        print(f"\nschemathesis ({name}): {tally.group(0) if tally else 'no tally'}")
        assert run.returncode == 0, output[-20000:]
        assert tally is not None and tally.group(1) == tally.group(2), output[-5000:]
        generated += int(tally.group(1))
    print(f"schemathesis: {generated} requests, 0 failures")
