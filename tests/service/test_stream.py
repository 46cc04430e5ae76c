"""The SSE stream of a job: history replayed, resumable with Last-Event-ID, ends when the job ends."""

from __future__ import annotations

import json

import httpx

from tests.conftest import Stack
from tests.helpers import chat_rows, upload_ok, wait_for


def _read_sse(response: httpx.Response) -> list[tuple[str, str, dict[str, object]]]:
    out: list[tuple[str, str, dict[str, object]]] = []
    event, ident, data = "message", "", ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("id: "):
            ident = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
        elif line == "" and data:
            out.append((event, ident, json.loads(data)))
            event, data = "message", ""
    return out


def test_stream_replays_resumes_and_ends(stack: Stack, stack_client: httpx.Client) -> None:
    train = upload_ok(stack_client, chat_rows(8))
    job_id = stack_client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": "tunehouse/tiny-llama",
            "training_file": train,
            "method": {
                "type": "supervised",
                "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 2}},
            },
        },
    ).json()["id"]

    # follow it live from the start
    with stack_client.stream("GET", f"/v1/fine_tuning/jobs/{job_id}/stream", timeout=240) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        live = _read_sse(response)
    assert live[-1][0] == "end" and live[-1][2]["status"] == "succeeded"
    steps = [d["step"] for e, _, d in live if e == "metrics"]
    assert steps == list(range(1, 9))
    assert any(e == "event" and str(d["message"]).startswith("Training started") for e, _, d in live)
    assert wait_for(stack_client, job_id)["status"] == "succeeded"

    # reconnect from the middle: exactly the rest, nothing repeated
    middle = len(live) // 2
    with stack_client.stream(
        "GET", f"/v1/fine_tuning/jobs/{job_id}/stream", headers={"Last-Event-ID": live[middle][1]}
    ) as response:
        rest = _read_sse(response)

    def keys(items: list[tuple[str, str, dict[str, object]]]) -> list[tuple[str, object]]:
        return sorted((e, d.get("id") or d.get("step")) for e, _, d in items if e != "end")

    # the replay may order events and metrics differently from the live feed, but holds the same items
    assert keys(rest) == keys(live[middle + 1 :])
    assert len(keys(rest)) < len(keys(live))
    assert rest[-1][0] == "end"


def test_stream_of_unknown_job_is_404(stack_client: httpx.Client) -> None:
    assert stack_client.get("/v1/fine_tuning/jobs/ftjob-missing/stream").status_code == 404
