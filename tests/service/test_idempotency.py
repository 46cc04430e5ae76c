"""`Idempotency-Key` on job creation (service/jobs/idempotency.py), through the API server: a retried
create returns the first job, never a second one (issue 46: a client that timed out and retried
created a duplicate job)."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.conftest import new_key
from tests.helpers import all_pages, chat_rows, upload_ok

MODEL = "tunehouse/tiny-llama"


@pytest.fixture
def train_file(client: httpx.Client) -> str:
    return upload_ok(client, chat_rows(8))


def _create(client: httpx.Client, key: str | None, **body: Any) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key is not None else {}
    return client.post("/v1/fine_tuning/jobs", json=body, headers=headers)


def _job_ids(client: httpx.Client) -> list[str]:
    return [job["id"] for job in all_pages(client, "/v1/fine_tuning/jobs")]


def test_a_retry_with_the_same_key_returns_the_first_job(client: httpx.Client, train_file: str) -> None:
    key = f"retry-{uuid.uuid4()}"
    first = _create(client, key, model=MODEL, training_file=train_file, suffix="once")
    assert first.status_code == 200, first.text
    # the same body with its keys in another order is the same request
    again = client.post(
        "/v1/fine_tuning/jobs",
        content=f'{{"suffix": "once", "training_file": "{train_file}", "model": "{MODEL}"}}',
        headers={"Idempotency-Key": key, "content-type": "application/json"},
    )
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["created_at"] == first.json()["created_at"]
    assert _job_ids(client) == [first.json()["id"]]


def test_the_same_key_with_another_body_is_a_409_naming_the_header(
    client: httpx.Client, train_file: str
) -> None:
    key = f"reuse-{uuid.uuid4()}"
    first = _create(client, key, model=MODEL, training_file=train_file, suffix="a")
    assert first.status_code == 200, first.text
    other = _create(client, key, model=MODEL, training_file=train_file, suffix="b")
    assert other.status_code == 409, other.text
    error = other.json()["error"]
    assert (error["param"], error["code"]) == ("Idempotency-Key", "idempotency_key_reused")
    assert first.json()["id"] in error["message"]
    assert _job_ids(client) == [first.json()["id"]]


def test_keys_are_per_tenant_and_optional(client: httpx.Client, train_file: str, api_url: str) -> None:
    key = f"shared-{uuid.uuid4()}"
    mine = _create(client, key, model=MODEL, training_file=train_file).json()["id"]
    with httpx.Client(
        base_url=api_url, headers={"Authorization": f"Bearer {new_key()}"}, timeout=60
    ) as other:
        theirs = _create(other, key, model=MODEL, training_file=upload_ok(other, chat_rows(8)))
        assert theirs.status_code == 200, theirs.text
        assert theirs.json()["id"] != mine
    # without a key every create is a new job
    a = _create(client, None, model=MODEL, training_file=train_file).json()["id"]
    b = _create(client, None, model=MODEL, training_file=train_file).json()["id"]
    assert len({mine, a, b}) == 3


def test_concurrent_requests_with_one_key_make_one_job(client: httpx.Client, train_file: str) -> None:
    key = f"race-{uuid.uuid4()}"
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(lambda _: _create(client, key, model=MODEL, training_file=train_file), range(8))
        )
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers if a.status_code != 200]
    assert len({a.json()["id"] for a in answers}) == 1
    assert _job_ids(client) == [answers[0].json()["id"]]


@pytest.mark.parametrize("key", ["", "x" * 256, "has space"])
def test_a_malformed_key_is_a_400_naming_the_header(client: httpx.Client, train_file: str, key: str) -> None:
    response = _create(client, key, model=MODEL, training_file=train_file)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "Idempotency-Key"


def test_the_openai_client_gets_one_job_for_one_key(api_url: str, api_key: str, train_file: str) -> None:
    """The official client (3.x) sends no idempotency header of its own (`_idempotency_header` is None
    on `openai.OpenAI`); a caller passes one with `extra_headers`, which its retries resend."""
    import openai

    oai = openai.OpenAI(base_url=f"{api_url}/v1", api_key=api_key, max_retries=0)
    try:
        assert oai._idempotency_header is None  # if a release starts sending one, honour its name too
        headers = {"Idempotency-Key": f"oai-{uuid.uuid4()}"}
        first = oai.fine_tuning.jobs.create(model=MODEL, training_file=train_file, extra_headers=headers)
        again = oai.fine_tuning.jobs.create(model=MODEL, training_file=train_file, extra_headers=headers)
        assert again.id == first.id and again.created_at == first.created_at
    finally:
        oai.close()
