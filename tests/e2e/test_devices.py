"""Devices in view on the live stack: the workers' page data (GET /v1/workers), a job's device in its
start event and its memory in every step row, and the workers' gauges in Prometheus' /metrics."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.conftest import METRICS_TOKEN, Stack
from tests.helpers import all_pages, wait_for


def test_workers_jobs_and_metrics_show_their_devices(stack: Stack, stack_client: httpx.Client) -> None:
    demo = Path("trainers/assets/demo_sft.jsonl").read_bytes()
    upload = stack_client.post("/v1/files", files={"file": ("d.jsonl", demo)}, data={"purpose": "fine-tune"})
    method = {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 3, "batch_size": 2}}}
    body = {"model": "tunehouse/tiny-llama", "training_file": upload.json()["id"], "method": method}
    job = stack_client.post("/v1/fine_tuning/jobs", json=body).json()
    # while it runs, the workers page shows it on its worker
    seen = None
    deadline = time.monotonic() + 120
    while seen is None and time.monotonic() < deadline:
        for worker in stack_client.get("/v1/workers").json()["data"]:
            if any(j["id"] == job["id"] for j in worker["jobs"]):
                seen = worker
        if stack_client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] in ("succeeded", "failed"):
            break
        time.sleep(0.2)
    assert seen is not None, "the running job was never listed on a worker"
    assert seen["device"] == "cpu" and seen["device_memory_bytes"] > 2**30
    assert seen["stats"]["gpus"] == [] and seen["stats"]["rss_bytes"] > 50 * 2**20
    assert time.time() - seen["seen_at"] < 60
    done = wait_for(stack_client, job["id"])
    assert done["status"] == "succeeded", done["error"]
    events = all_pages(stack_client, f"/v1/fine_tuning/jobs/{job['id']}/events")
    started = next(e for e in events if e["message"].startswith("Job started"))
    assert "[cpu: " in started["message"] and started["data"]["device"] == "cpu"
    rows = all_pages(stack_client, f"/v1/fine_tuning/jobs/{job['id']}/metrics")
    assert rows and all(r["rss_bytes"] > 50 * 2**20 for r in rows)  # the trainer's memory, every step
    metrics = httpx.get(f"{stack.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).text
    assert f'tunehouse_worker_rss_bytes{{worker="{seen["id"]}",device="cpu"}}' in metrics
