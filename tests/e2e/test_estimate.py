"""The pre-flight estimate (POST /v1/fine_tuning/jobs/estimate) on the real stack: uvicorn + a training
worker + an inference worker (which reads the file with the model's tokenizer) + Redis + PostgreSQL.

Its figures are held to the run they predict: the same body created as a job trains exactly the
estimated trained tokens in exactly the estimated steps, and once it has run, the next estimate's wall
time comes from its throughput. The estimate itself stores nothing and refuses what creation refuses.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import tunehouse
from tests.conftest import Stack, new_key
from tests.helpers import all_pages, chat_rows, stored_counts, tenant_of, until, upload_ok, wait_for
from tests.sdk.test_cli import th

BASE = "tunehouse/tiny-llama"
MAX_LENGTH = 40
LONG = {
    "messages": [
        {"role": "user", "content": "Count to forty."},
        {"role": "assistant", "content": "That is " + " ".join(str(i) for i in range(40))},
    ]
}


def _body(file_id: str, **hp: Any) -> dict[str, Any]:
    hyperparameters = {"n_epochs": 2, "batch_size": 4, "max_length": MAX_LENGTH, **hp}
    return {
        "model": BASE,
        "training_file": file_id,
        "seed": 5,
        "method": {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}},
    }


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    key = new_key()
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
        client.headers["x-test-tenant"] = tenant_of(key)
        client.headers["x-test-key"] = key
        yield client


def _trains_as_estimated(http: httpx.Client, body: dict[str, Any], estimate: dict[str, Any]) -> None:
    """The job created from ``body`` succeeds in the estimated steps, with the estimated tokens."""
    created = http.post("/v1/fine_tuning/jobs", json=body)
    assert created.status_code == 200, created.text
    job = wait_for(http, created.json()["id"])
    assert job["status"] == "succeeded", job
    rows = all_pages(http, f"/v1/fine_tuning/jobs/{job['id']}/metrics")
    last = [r for r in rows if "trained_tokens" in r][-1]
    assert last["step"] == estimate["total_steps"]
    assert last["trained_tokens"] == estimate["trained_tokens"]["total"]


def test_estimate_predicts_the_run_and_stores_nothing(http: httpx.Client) -> None:
    tenant = http.headers["x-test-tenant"]
    file_id = upload_ok(http, [*chat_rows(10), LONG])
    before = stored_counts(tenant)
    answer = http.post("/v1/fine_tuning/jobs/estimate", json=_body(file_id))
    assert answer.status_code == 200, answer.text
    estimate = answer.json()
    assert stored_counts(tenant) == before  # no job, event or metric: nothing to send a run message for
    assert estimate["object"] == "fine_tuning.job.estimate"
    assert (estimate["examples"], estimate["trained_examples"]) == (11, 11)
    assert estimate["truncated"] == {"count": 1, "first_lines": [11], "dropped_lines": []}
    assert estimate["queue_position"] == 1
    # the first example as trained: the assistant's answer trains, the prompt does not
    first = estimate["preview"][0]
    trained = "".join(s["text"] for s in first if s["trained"])
    assert "0 plus 0 is 0." in trained and "What is" not in trained
    assert any(not s["trained"] and "What is 0 plus 0?" in s["text"] for s in first)
    # the stack's training worker advertises its device
    fits = until(
        lambda: http.post("/v1/fine_tuning/jobs/estimate", json=_body(file_id)).json()["peak_memory_bytes"],
        "a live worker kind",
        timeout=60,
    )
    kind = fits[0]
    assert kind["worker_kind"]["device"] == "cpu" and kind["fits"] is True
    parts = kind["peak_memory_bytes"]
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total") > 0

    _trains_as_estimated(http, _body(file_id), estimate)
    tokens = estimate["trained_tokens"]
    assert tokens["total"] == 2 * tokens["per_epoch"] and 0 < tokens["loss_per_epoch"] < tokens["per_epoch"]

    again = http.post("/v1/fine_tuning/jobs/estimate", json=_body(file_id)).json()
    wall = again["estimated_wall_time"]
    assert wall["seconds"] is not None and wall["measured_jobs"] >= 1 and wall["tokens_per_second"] > 0
    # the answer gives seconds to a tenth (abs) and the rate to a tenth of a token (rel)
    assert wall["seconds"] == pytest.approx(
        again["trained_tokens"]["total"] / wall["tokens_per_second"], rel=0.01, abs=0.05
    )


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"training_file": "file-nope"}, "training_file"),
        ({"model": "no/such-model"}, "model"),
        ({"hp": {"max_length": 4}}, "method.supervised.hyperparameters.max_length"),
    ],
)
def test_estimate_refuses_what_creation_refuses(
    http: httpx.Client, change: dict[str, Any], param: str
) -> None:
    tenant = http.headers["x-test-tenant"]
    file_id = upload_ok(http, chat_rows(4))
    body = _body(file_id, **change.pop("hp", {}))
    body.update(change)
    before = stored_counts(tenant)
    for path in ("/v1/fine_tuning/jobs/estimate", "/v1/fine_tuning/jobs"):
        answer = http.post(path, json=body)
        assert answer.status_code == 400, (path, answer.text)
        assert answer.json()["error"]["param"] == param, (path, answer.json())
    assert stored_counts(tenant) == before


def test_sdk_and_cli_estimate(stack: Stack, http: httpx.Client) -> None:
    key = http.headers["x-test-key"]
    file_id = upload_ok(http, chat_rows(6))
    body = _body(file_id)
    expected = http.post("/v1/fine_tuning/jobs/estimate", json=body).json()
    with tunehouse.Client(base_url=stack.url, api_key=key) as client:
        estimate = client.fine_tuning.jobs.estimate(**body)
    assert isinstance(estimate, tunehouse.types.JobEstimate)
    assert (estimate.total_steps, estimate.trained_tokens) == (
        expected["total_steps"],
        expected["trained_tokens"],
    )

    async def estimate_async() -> tunehouse.types.JobEstimate:
        async with tunehouse.AsyncClient(base_url=stack.url, api_key=key) as client:
            return await client.fine_tuning.jobs.estimate(**body)

    assert asyncio.run(estimate_async()).trained_tokens == expected["trained_tokens"]
    cli = (
        "jobs",
        "estimate",
        "--model",
        BASE,
        "--training-file",
        file_id,
        "-p",
        "n_epochs=2",
        "-p",
        "batch_size=4",
    )
    shown = th(*cli, "-p", f"max_length={MAX_LENGTH}", url=stack.url, key=key)
    assert shown.returncode == 0, shown.stderr
    tokens = expected["trained_tokens"]
    assert f"trained tokens: {tokens['per_epoch']} per epoch, {tokens['total']} in all" in shown.stdout
    assert "[[0 plus 0 is 0." in shown.stdout  # the trained tokens of the first example, marked
    as_json = th(*cli, "-p", f"max_length={MAX_LENGTH}", "--json", url=stack.url, key=key)
    assert json.loads(as_json.stdout)["object"] == "fine_tuning.job.estimate"


def test_a_preference_job_estimate_predicts_its_run(http: httpx.Client) -> None:
    """A DPO job's file is counted as training reads it: each pair as prompt + chosen and prompt +
    rejected (a pair whose chosen answer runs past max_length is cut), the completions trained; the
    job then trains exactly the estimated tokens in the estimated steps."""
    from tests.e2e.test_preference_methods import preference_rows

    long = {"prompt": "Count to forty.", "chosen": " ".join(map(str, range(40))), "rejected": "No."}
    file_id = upload_ok(http, [*preference_rows(7, openai_shape=False), long])
    hp = {"n_epochs": 2, "batch_size": 4, "max_length": MAX_LENGTH, "beta": 0.1}
    body = {
        "model": BASE,
        "training_file": file_id,
        "seed": 5,
        "method": {"type": "dpo", "dpo": {"hyperparameters": hp}},
    }
    answer = http.post("/v1/fine_tuning/jobs/estimate", json=body)
    assert answer.status_code == 200, answer.text
    estimate = answer.json()
    assert (estimate["examples"], estimate["trained_examples"]) == (8, 8)
    assert estimate["truncated"] == {"count": 1, "first_lines": [8], "dropped_lines": []}
    assert estimate["tokens_reason"] is None
    chosen, rejected = estimate["preview"][:2]  # the first pair's two sequences
    for sequence, answer_text in ((chosen, "Happy to help: 0."), (rejected, "Go away. 1.")):
        assert answer_text in "".join(s["text"] for s in sequence if s["trained"])
        assert "What is 0 plus 0?" in "".join(s["text"] for s in sequence if not s["trained"])
    _trains_as_estimated(http, body, estimate)


def test_a_job_that_would_train_nothing_does_not_fit(http: httpx.Client) -> None:
    """Every example's answer lies past max_length: the job would "succeed" having trained nothing, so the
    estimate answers fits: false and says why (it used to say the job fits)."""
    prompt = "Tell me everything you know, in order, at length: " + " ".join(str(i) for i in range(30))
    rows = [{"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": "ok"}]}] * 3
    file_id = upload_ok(http, rows)
    estimate = http.post("/v1/fine_tuning/jobs/estimate", json=_body(file_id, max_length=8)).json()
    assert estimate["trained_examples"] == 0
    assert estimate["fits"] is False
    assert estimate["reason"] == (
        "the job would train nothing: no example keeps a token to train on at max_length 8 (lines 1, 2, 3); "
        "raise max_length or check the assistant turns' weights"
    )
    # the same file with room for the answers runs
    assert (
        http.post("/v1/fine_tuning/jobs/estimate", json=_body(file_id, max_length=200)).json()["fits"] is True
    )
