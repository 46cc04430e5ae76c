"""The API while its PostgreSQL is down: every DB-backed endpoint answers 503 with Retry-After in the
error envelope (never a 500, nothing half-stored), /readyz says 503 and /healthz stays 200; when the
database is back the same server answers again by itself, without a restart."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.faults.servers import FaultStack
from tests.helpers import chat_rows, jsonl, upload_ok

MODEL = "tunehouse/tiny-llama"


def _requests(file_id: str, job_id: str) -> list[tuple[str, str, dict[str, Any]]]:
    job = f"/v1/fine_tuning/jobs/{job_id}"
    return [
        ("GET", "/v1/files", {}),
        (
            "POST",
            "/v1/files",
            {"files": {"file": ("t.jsonl", jsonl(chat_rows(2)))}, "data": {"purpose": "fine-tune"}},
        ),
        ("GET", f"/v1/files/{file_id}", {}),
        ("GET", f"/v1/files/{file_id}/content", {}),
        ("DELETE", f"/v1/files/{file_id}", {}),
        ("GET", "/v1/fine_tuning/jobs", {}),
        ("POST", "/v1/fine_tuning/jobs", {"json": {"model": MODEL, "training_file": file_id}}),
        ("GET", job, {}),
        ("POST", f"{job}/cancel", {}),
        ("GET", f"{job}/events", {}),
        ("GET", f"{job}/checkpoints", {}),
        ("GET", f"{job}/metrics", {}),
        ("GET", f"{job}/stream", {}),
        ("GET", "/v1/models", {}),
        ("GET", f"/v1/models/{MODEL}", {}),
    ]


def test_database_outage_is_503_and_the_api_recovers_by_itself(fault_stack: FaultStack) -> None:
    url, server = fault_stack.start_api()
    key = fault_stack.new_key()
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    file_id = upload_ok(client, chat_rows(8))
    created = client.post("/v1/fine_tuning/jobs", json={"model": MODEL, "training_file": file_id})
    assert created.status_code == 200, created.text
    job_id = created.json()["id"]
    blobs_before = sorted(p.name for p in (fault_stack.data_dir / "blobs").rglob("*") if p.is_file())

    fault_stack.pg.stop()
    stopped = time.monotonic()
    answers: dict[str, int] = {}
    for method, path, kwargs in _requests(file_id, job_id):
        response = client.request(method, path, **kwargs)
        answers[f"{method} {path}"] = response.status_code
        assert response.status_code == 503, (method, path, response.text)
        assert int(response.headers["retry-after"]) > 0
        error = response.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "database_unavailable", error
        assert response.headers["x-request-id"].startswith("req_")
    assert httpx.get(f"{url}/readyz").status_code == 503
    assert httpx.get(f"{url}/healthz").status_code == 200
    outage_answered = time.monotonic() - stopped
    assert server.poll() is None  # still the same process

    fault_stack.pg.start()
    restarted = time.monotonic()
    while (status := client.get(f"/v1/fine_tuning/jobs/{job_id}").status_code) != 200:
        assert status == 503, status
        assert time.monotonic() - restarted < 30, "the API did not recover within 30 s of the database"
        time.sleep(0.05)
    recovery = time.monotonic() - restarted
    assert httpx.get(f"{url}/readyz").status_code == 200

    # the same server, and nothing was stored or changed by the requests answered 503
    assert server.poll() is None
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "queued"
    assert [f["id"] for f in client.get("/v1/files").json()["data"]] == [file_id]
    assert [j["id"] for j in client.get("/v1/fine_tuning/jobs").json()["data"]] == [job_id]
    blobs_after = sorted(p.name for p in (fault_stack.data_dir / "blobs").rglob("*") if p.is_file())
    assert blobs_after == blobs_before
    print(
        f"\npostgres down: {len(answers)} DB-backed requests answered 503 + Retry-After in "
        f"{outage_answered:.2f}s, /readyz 503, /healthz 200; API recovered {recovery:.2f}s after the "
        "database restarted (no API restart)"
    )
    client.close()
