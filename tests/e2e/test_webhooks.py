"""Webhooks through the whole stack: uvicorn + Celery worker over Redis + PostgreSQL + trainer process,
delivering to a real HTTP receiver (tests/webhook_receiver.py) that verifies every signature and
answers 500 to the first attempt of each event on one endpoint, so every event there is retried.

Three real jobs produce every event type: one trains to success (queued, running, checkpoints,
succeeded), one fails on the worker (its training file's bytes are lost), one is paused and cancelled.
Run with `-s` to see the delivery figures (sent, retried, delivered, signature failures).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import DATA_DIR
from tests.helpers import all_pages, chat_rows, upload_ok, wait_for
from tests.webhook_receiver import Receiver, start_receiver

MODEL = "tunehouse/tiny-llama"
JOB = "fine_tuning.job"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rec, server = start_receiver()
    yield rec
    server.shutdown()
    server.server_close()


def _endpoint(client: httpx.Client, receiver: Receiver, path: str, **body: Any) -> str:
    created = client.post("/v1/webhooks", json={"url": receiver.url(path), **body})
    assert created.status_code == 200, created.text
    receiver.secrets[path] = created.json()["secret"]
    return str(created.json()["id"])


def _by_job(events: list[dict[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for event in events:
        out.setdefault(event["data"]["id"], []).append(event["type"])
    return out


def test_a_job_lifecycle_is_delivered_signed_and_retried(
    stack_client: httpx.Client, receiver: Receiver
) -> None:
    receiver.fail_first.add("/all")
    everything = _endpoint(stack_client, receiver, "/all")
    outcomes = _endpoint(stack_client, receiver, "/outcomes", events=[f"{JOB}.succeeded", f"{JOB}.failed"])

    hp = {"n_epochs": 1, "batch_size": 8, "save_steps": 1}
    trained = stack_client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": MODEL,
            "training_file": upload_ok(stack_client, chat_rows(16)),
            "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
        },
    ).json()["id"]
    lost = upload_ok(stack_client, chat_rows(8))
    (blob,) = DATA_DIR.joinpath("blobs", "files").rglob(f"{lost}.jsonl")
    blob.unlink()
    failed = stack_client.post("/v1/fine_tuning/jobs", json={"model": MODEL, "training_file": lost}).json()[
        "id"
    ]
    stopped = stack_client.post(
        "/v1/fine_tuning/jobs", json={"model": MODEL, "training_file": upload_ok(stack_client, chat_rows(8))}
    ).json()["id"]
    assert stack_client.post(f"/v1/fine_tuning/jobs/{stopped}/pause").status_code == 200
    assert wait_for(stack_client, stopped, ("paused",))["status"] == "paused"
    assert stack_client.post(f"/v1/fine_tuning/jobs/{stopped}/cancel").status_code == 200
    assert wait_for(stack_client, trained)["status"] == "succeeded"
    assert wait_for(stack_client, failed)["status"] == "failed"
    checkpoints = all_pages(stack_client, f"/v1/fine_tuning/jobs/{trained}/checkpoints")
    assert len(checkpoints) >= 2  # step 1 and the final model

    # the paused job may have started before its pause (then it was running, checkpointed, paused)
    expected = {
        trained: [f"{JOB}.queued", f"{JOB}.running"] + [f"{JOB}.checkpoint.created"] * len(checkpoints),
        failed: [f"{JOB}.queued", f"{JOB}.running", f"{JOB}.failed"],
    }
    expected[trained].append(f"{JOB}.succeeded")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        got = _by_job(receiver.delivered("/all"))
        if all(
            sorted(got.get(j, [])) == sorted(t) for j, t in expected.items()
        ) and f"{JOB}.cancelled" in got.get(stopped, []):
            break
        time.sleep(0.2)
    got = _by_job(receiver.delivered("/all"))
    for job_id, types in expected.items():
        assert sorted(got.get(job_id, [])) == sorted(types), (job_id, got)
    assert got[stopped][0] == f"{JOB}.queued" and got[stopped][-1] == f"{JOB}.cancelled"
    assert f"{JOB}.paused" in got[stopped]
    ckpt_events = [e for e in receiver.delivered("/all") if e["type"] == f"{JOB}.checkpoint.created"]
    assert sorted(e["data"]["checkpoint_id"] for e in ckpt_events) == sorted(c["id"] for c in checkpoints)

    outcome_events = _by_job(receiver.delivered("/outcomes"))
    assert outcome_events == {trained: [f"{JOB}.succeeded"], failed: [f"{JOB}.failed"]}

    # the delivery log: each event on /all failed once (500), then went through (200); the worker
    # records an attempt just after the receiver answers it, so the last rows may still be settling
    log = all_pages(stack_client, f"/v1/webhooks/{everything}/deliveries")
    while any(d["status"] == "pending" for d in log) and time.monotonic() < deadline:
        time.sleep(0.2)
        log = all_pages(stack_client, f"/v1/webhooks/{everything}/deliveries")
    assert log and all(d["status"] == "delivered" for d in log)
    assert all([a["status_code"] for a in d["attempts"]] == [500, 200] for d in log), log
    assert all(d["attempts"][0]["error"].startswith("HTTP 500") for d in log)
    assert {d["event_id"] for d in log} == {e["id"] for e in receiver.delivered("/all")}
    first_try = all_pages(stack_client, f"/v1/webhooks/{outcomes}/deliveries")
    assert [len(d["attempts"]) for d in first_try] == [1, 1]

    figures = receiver.figures()
    print(f"\nwebhook delivery figures: {figures}")
    assert figures["signature_failures"] == 0
    assert figures["delivered"] == len(log) + 2
    assert figures["retried"] == len(log)
    assert figures["sent"] == 2 * len(log) + 2
