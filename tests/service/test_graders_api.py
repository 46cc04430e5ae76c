"""POST /v1/fine_tuning/alpha/graders/validate and /run on the live uvicorn server, in OpenAI's shapes,
driven by httpx and by the official `openai` client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

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


def test_python_grader_runs_sandboxed_and_reports_its_errors(tmp_path: Path) -> None:
    """With the operator's opt-in (a server of its own): scores come from the tenant's code; an exception
    in it is OpenAI's python_grader_runtime_error, not a failed request. Issue 56's probes, sent as
    graders, are each denied by the sandbox: not the API's environment (its metrics token), not its data
    dir, database or Redis, and nothing they start outlives the run."""
    from sqlalchemy.engine import make_url

    from tests.conftest import DATA_DIR, PG_SERVER, REDIS, new_key
    from tests.trainers.rewards.sandbox_probes import PROBES, context, lingering, shared_memory

    ports = {"postgres_port": make_url(PG_SERVER).port or 5432, "redis_port": urlsplit(REDIS).port or 6379}
    root = Path(__file__).resolve().parents[2]  # the installation dir
    probed = context(tmp_path, f"probe-{os.urandom(4).hex()}", install_dir=root, **ports)
    probed.update(data_dir=str(DATA_DIR), marker="service.app:app")  # the API's own, as a tenant finds them
    probed["shm_id"], remove_shared_memory = shared_memory()
    url, proc = start_server(
        {
            "TUNEHOUSE_ALLOW_PYTHON_GRADER": "1",
            "TUNEHOUSE_PYTHON_GRADER_TIMEOUT_SECONDS": "3",
            "TUNEHOUSE_PYTHON_GRADER_MEMORY_MB": "256",
            "TUNEHOUSE_METRICS_TOKEN": probed["secret"],
        }
    )
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
            for name, probe in PROBES.items():
                grader = {"type": "python", "name": "probe", "source": probe}
                run = c.post(RUN, json={"grader": grader, "model_sample": "x", "item": probed})
                assert run.status_code == 200, (name, run.text)
                assert run.json()["reward"] == 0.0, (name, run.json())
                assert lingering(probed) == [], name
    finally:
        remove_shared_memory()
        _stop(proc)


def test_python_graders_refuse_to_start_without_a_sandbox(tmp_path: Path) -> None:
    """Enabled on a host without bubblewrap (here: a PATH without it), the API does not start and says
    why; with the operator's explicit unsafe flag it starts, and tenant code then runs unsandboxed."""
    from sqlalchemy.engine import make_url

    from tests.conftest import PG_SERVER, free_port, new_key
    from tests.trainers.rewards.sandbox_probes import PROBES

    enabled = {**os.environ, "TUNEHOUSE_ALLOW_PYTHON_GRADER": "1", "PATH": str(tmp_path)}
    command = [sys.executable, "-m", "uvicorn", "service.app:app", "--port", str(free_port())]
    refused = subprocess.run(command, env=enabled, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode != 0
    assert (
        "TUNEHOUSE_ALLOW_PYTHON_GRADER=1 runs tenant code in a bubblewrap sandbox, which this host cannot "
        "provide: bubblewrap is not installed" in refused.stderr
    ), refused.stderr

    url, proc = start_server({**enabled, "TUNEHOUSE_PYTHON_GRADER_UNSAFE_NO_SANDBOX": "1"})
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {new_key()}"}, timeout=60) as c:
            grader = {"type": "python", "name": "probe", "source": PROBES["connect to PostgreSQL"]}
            item = {"postgres_port": make_url(PG_SERVER).port or 5432}
            run = c.post(RUN, json={"grader": grader, "model_sample": "x", "item": item})
            assert run.json()["reward"] == 1.0, run.json()  # what the flag's name warns of
    finally:
        _stop(proc)


# the template case: 5,000 copies of {{item.r}}, a 100 KB item.r (a 150 KB body)
COPIES = {
    "grader": {**EXACT, "reference": "{{item.r}}" * 5000},
    "model_sample": "x",
    "item": {"r": "r" * 100_000},
}
# under each cap, but 2,000 copies of a 10,000-character field: 20,000,000 characters expanded
EXPANDS = {
    "grader": {**EXACT, "reference": "{{item.r}}" * 2000},
    "model_sample": "x",
    "item": {"r": "r" * 10_000},
}
LONG_SAMPLE = {"grader": EXACT, "model_sample": "s" * 20_001, "item": {"answer": "x"}}


# -- limits (issue 46) ---------------------------------------------------------------------------------
def _heavy_text(n: int, seed: int) -> str:
    """Text that makes difflib slow: 101 symbols, each too rare in a long text to be junked (autojunk
    drops those above 1%), so every position of one text meets ~1/101 of the other's. Mostly ASCII: a
    400,000-character reference stays under the 1 MiB body limit."""
    import random

    ascii_ = [chr(c) for c in range(0x21, 0x7F) if chr(c) not in "{}"]  # no template braces
    symbols = ascii_ + [chr(c) for c in range(0xC0, 0xC0 + 101 - len(ascii_))]
    rng = random.Random(seed)
    return "".join(rng.choice(symbols) for _ in range(n))


def _post_utf8(client: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    """As `client.post(json=...)`, in UTF-8 rather than \\u escapes (6 bytes a character)."""
    content = json.dumps(body, ensure_ascii=False).encode()
    return client.post(path, content=content, headers={"content-type": "application/json"})


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        # issue 46's inputs: 60.8 s of the API's CPU; 13.7 s; a multi of 2,000 accepted; 117 -> 584 MB
        (
            RUN,
            {"grader": {**CLOSE, "reference": "r" * 400_000}, "model_sample": "s" * 20_000},
            "grader.reference",
            "400000 characters; at most 20000",
        ),
        (
            RUN,
            {
                "grader": {**MULTI, "graders": {f"g{i}": {**CLOSE, "name": f"g{i}"} for i in range(4)},
                           "calculate_output": "g0 + g1 + g2 + g3"},
                "model_sample": "x",
                "item": {"answer": "a" * 240_000},
            },
            "item",
            "at most 65536",
        ),
        (
            VALIDATE,
            {"grader": {**MULTI, "graders": {f"g{i}": {**EXACT, "name": f"g{i}"} for i in range(2000)},
                        "calculate_output": "g0"}},
            "grader.graders",
            "2000 graders; at most 16",
        ),
        (RUN, COPIES, "grader.reference", "50000 characters"),
        (RUN, EXPANDS, "grader.reference", "expands to 20000000 characters"),  # refused before it is built
        (RUN, LONG_SAMPLE, "model_sample", "20001"),
        (VALIDATE, {"grader": {**EXACT, "input": "{{sample.output_text}}" * 1000}}, "grader.input", "22000"),
    ],
)  # fmt: skip
def test_grader_sizes_are_capped_with_a_400_naming_the_field(
    client: httpx.Client, path: str, body: dict[str, Any], param: str, fragment: str
) -> None:
    started = time.monotonic()
    error = _error(client.post(path, json=body))
    assert error["param"] == param and fragment in error["message"], error
    assert error["code"] == "grader_too_large"
    assert time.monotonic() - started < 2.0


def test_a_run_grades_in_a_child_under_the_python_graders_limits() -> None:
    """With the size caps lifted, the issue's inputs reach the grading itself: it runs in a child
    process with python_grader_timeout_seconds of CPU and python_grader_memory_mb of memory, so the
    API answers a 400 within that time and its own memory stays where it was."""
    from tests.conftest import new_key

    url, proc = start_server(
        {
            "TUNEHOUSE_PYTHON_GRADER_TIMEOUT_SECONDS": "1",
            "TUNEHOUSE_PYTHON_GRADER_MEMORY_MB": "256",
            "TUNEHOUSE_GRADER_MAX_TEXT_CHARS": "1000000000",
            "TUNEHOUSE_GRADER_MAX_ITEM_BYTES": "1000000",
        }
    )
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {new_key()}"}, timeout=120) as c:
            ok = c.post(RUN, json={"grader": MULTI, "model_sample": "Lime", "item": {"answer": "Lima"}})
            assert ok.status_code == 200 and ok.json()["sub_rewards"] == {"exact": 0.0, "close": 0.75}
            rss_before = _rss_kb(proc.pid)

            started = time.monotonic()
            slow = {
                "grader": {**CLOSE, "reference": _heavy_text(400_000, 1)},
                "model_sample": _heavy_text(20_000, 2),
            }
            error = _error(_post_utf8(c, RUN, slow))
            assert (error["param"], error["code"]) == ("grader", "grader_limit_exceeded"), error
            assert "1 s" in error["message"]
            assert time.monotonic() - started < 1 + 2 + 2  # the limit, the child's slack, the request

            huge = {
                "grader": {**EXACT, "reference": "{{item.r}}" * 5000},
                "model_sample": "x",
                "item": {"r": "r" * 100_000},
            }
            error = _error(c.post(RUN, json=huge))
            assert (error["param"], error["code"]) == ("grader", "grader_limit_exceeded"), error
            assert "256 MB" in error["message"]
            assert _rss_kb(proc.pid) - rss_before < 50_000, "the API process grew: it graded in itself"
    finally:
        _stop(proc)


def test_a_grader_on_the_sampled_tool_calls_runs_on_a_text_sample(client: httpx.Client) -> None:
    """``{{sample.output_tools[0].function.name}}`` (OpenAI's way to grade a tool call) validates; a
    ``model_sample`` is text, a reply without calls, so the call's name reads as nothing."""
    called = {**EXACT, "input": "{{sample.output_tools[0].function.name}}", "reference": "get_weather"}
    assert client.post(VALIDATE, json={"grader": called}).status_code == 200
    run = client.post(RUN, json={"grader": called, "model_sample": "get_weather"})
    assert run.status_code == 200, run.text
    assert run.json()["reward"] == 0.0
    bad = {**called, "input": "{{sample.output_json}}"}
    assert _error(client.post(VALIDATE, json={"grader": bad}))["param"] == "grader.input"
