"""POST /v1/fine_tuning/alpha/graders/validate and /run on the live uvicorn server, in OpenAI's shapes,
driven by httpx and by the official `openai` client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import _stop, start_server

VALIDATE, RUN = "/v1/fine_tuning/alpha/graders/validate", "/v1/fine_tuning/alpha/graders/run"

EXACT = {
    "type": "string_check",
    "name": "exact",
    "operation": "eq",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
}
CLOSE = {
    "type": "text_similarity",
    "name": "close",
    "evaluation_metric": "fuzzy_match",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
}
MULTI = {
    "type": "multi",
    "name": "both",
    "graders": {"exact": EXACT, "close": CLOSE},
    "calculate_output": "0.25 * exact + 0.75 * close",
}


@pytest.fixture
def oai(api_url: str, api_key: str) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{api_url}/v1", api_key=api_key, max_retries=0)
    yield client
    client.close()


def _error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def test_openai_client_validates_and_runs_a_multi_grader(oai: openai.OpenAI) -> None:
    validated = oai.fine_tuning.alpha.graders.validate(grader=MULTI)  # type: ignore[arg-type]
    assert validated.grader is not None and validated.grader.type == "multi"

    run = oai.fine_tuning.alpha.graders.run(
        grader=MULTI,  # type: ignore[arg-type]
        model_sample="Lime",
        item={"answer": "Lima"},
    )
    # exact: "Lime" != "Lima" -> 0; fuzzy: 2 * 3 matching / 8 characters = 0.75
    assert run.sub_rewards == {"exact": 0.0, "close": 0.75}
    assert run.reward == pytest.approx(0.25 * 0.0 + 0.75 * 0.75)
    assert run.metadata.name == "both" and run.metadata.type == "multi"
    assert run.metadata.scores == {"both": run.reward, "exact": 0.0, "close": 0.75}
    assert not run.metadata.errors.python_grader_runtime_error and run.metadata.execution_time >= 0


def test_run_one_grader(client: httpx.Client) -> None:
    for sample, expected in (("Lima", 1.0), ("lima", 0.0)):
        body = client.post(RUN, json={"grader": EXACT, "model_sample": sample, "item": {"answer": "Lima"}})
        assert body.status_code == 200, body.text
        assert body.json()["reward"] == expected and body.json()["sub_rewards"] == {}
    like = {**EXACT, "operation": "ilike", "reference": "{{item.city.name}}"}
    body = client.post(
        RUN, json={"grader": like, "model_sample": "It is LIMA.", "item": {"city": {"name": "lima"}}}
    )
    assert body.json()["reward"] == 1.0


def test_validate_echoes_the_grader_with_defaults(client: httpx.Client) -> None:
    body = client.post(VALIDATE, json={"grader": {k: v for k, v in EXACT.items() if k != "name"}})
    assert body.status_code == 200, body.text
    assert body.json()["grader"]["name"] == "grader" and body.json()["grader"]["operation"] == "eq"


@pytest.mark.parametrize(
    ("grader", "param", "fragment"),
    [
        ({**EXACT, "reference": "{{items.answer}}"}, "grader.reference", "not a template variable"),
        ({**EXACT, "input": "{{sample.text}}"}, "grader.input", "sample.text"),
        (
            {**MULTI, "graders": {"exact": {**EXACT, "input": "{{ output }}"}, "close": CLOSE}},
            "grader.graders.exact.input",
            "not a template variable",
        ),
        ({**MULTI, "graders": {"my-grader": EXACT}, "calculate_output": "1"}, "grader.graders", "identifier"),
        ({**MULTI, "calculate_output": "exact ** 2"}, "grader.calculate_output", "+ - * /"),
        ({**EXACT, "operation": "equals"}, "grader.operation", "eq"),
        (
            {**MULTI, "graders": {"exact": {**EXACT, "operation": "equals"}, "close": CLOSE}},
            "grader.graders.exact.operation",
            "eq",
        ),
        (
            {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0"},
            "grader.type",
            "disabled",
        ),
        ({"type": "score_model", "name": "rm", "model": "ft:nope"}, "grader.model", "reward model"),
    ],
)
def test_bad_graders_are_400s_naming_the_field(
    client: httpx.Client, grader: dict[str, Any], param: str, fragment: str
) -> None:
    for path, extra in ((VALIDATE, {}), (RUN, {"model_sample": "x", "item": {"answer": "x"}})):
        error = _error(client.post(path, json={"grader": grader, **extra}))
        assert error["param"] == param and fragment in error["message"], (path, error)


def test_run_errors_name_the_field(client: httpx.Client) -> None:
    # the item lacks the field a template reads
    error = _error(client.post(RUN, json={"grader": MULTI, "model_sample": "x", "item": {"city": "x"}}))
    assert error["param"] == "grader.graders.exact.reference" and "item.answer" in error["message"]
    # a formula that divides by a zero score
    zero = {**MULTI, "calculate_output": "close / exact"}
    error = _error(
        client.post(RUN, json={"grader": zero, "model_sample": "Lime", "item": {"answer": "Lima"}})
    )
    assert error["param"] == "grader.calculate_output" and "exact=0" in error["message"]
    error = _error(client.post(RUN, json={"grader": EXACT, "item": {"answer": "x"}}))
    assert error["param"] == "model_sample"
    error = _error(client.post(RUN, json={"grader": EXACT, "model_sample": "x", "item": ["x"]}))
    assert error["param"] == "item"


def test_python_grader_runs_sandboxed_and_reports_its_errors() -> None:
    """With the operator's opt-in (a server of its own): scores come from the tenant's code; an exception
    in it is OpenAI's python_grader_runtime_error, not a failed request."""
    from tests.conftest import new_key

    url, proc = start_server({"TUNEHOUSE_ALLOW_PYTHON_GRADER": "1"})
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {new_key()}"}, timeout=60) as c:
            source = "def grade(sample, item):\n    return len(sample['output_text']) / item['n']"
            grader = {"type": "python", "name": "length", "source": source}
            ok = c.post(RUN, json={"grader": grader, "model_sample": "abc", "item": {"n": 4}})
            assert ok.status_code == 200, ok.text
            assert (
                ok.json()["reward"] == 0.75
                and not ok.json()["metadata"]["errors"]["python_grader_runtime_error"]
            )
            failed = c.post(RUN, json={"grader": grader, "model_sample": "abc", "item": {"n": 0}}).json()
            assert failed["reward"] == 0.0
            errors = failed["metadata"]["errors"]
            assert (
                errors["python_grader_runtime_error"]
                and "ZeroDivisionError" in errors["python_grader_runtime_error_details"]
            )
    finally:
        _stop(proc)
