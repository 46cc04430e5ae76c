"""The Tinker API's cost per call beyond compute, and its training throughput against the same work as a
tunehouse job.

    make bench TRAINER_BENCH=--skip ARGS="-k tinker_overhead -s"

A real uvicorn server and a real Tinker host (worker/tinker_host.py) over real Redis, on the tiny model.

1. Overhead per call: `TINKER_CALLS` `forward` calls (one datum of `TINKER_TOKENS` tokens) sent as the SDK
   sends them (its protobuf body, POST forward_backward, then POST retrieve_future until the result),
   timed by the client from the first byte sent to the result read; the host stamps each result with its
   own time in the call (`compute_s`). Overhead = client wall - host compute, per call; p50 and p90.
   The same through the SDK's `TrainingClient.forward(...).result()` (its threads and futures included).
2. Throughput: `TINKER_ROWS` plain-text rows, one epoch, batch `TINKER_BATCH`, LoRA rank 8, as an SFT job
   (trained tokens over the job's running time, from `started_at` to `finished_at`: whole seconds, model
   load and checkpoints included) and as the SDK loop (forward_backward + optim_step per batch; tokens
   over the loop's wall, the client's creation included).
Both sides' torch runs with one thread (`OMP_NUM_THREADS=1`, as the tests do).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from service.tinker import channel
from tests.conftest import WORKER_BROKER, _stop, new_key, start_server
from tests.helpers import start_tinker_host, upload_ok

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

CALLS = int(os.environ.get("TINKER_CALLS", "100"))
TOKENS = int(os.environ.get("TINKER_TOKENS", "64"))
ROWS = int(os.environ.get("TINKER_ROWS", "256"))
BATCH = int(os.environ.get("TINKER_BATCH", "8"))
MODEL = "tunehouse/tiny-llama"
# the SDK leaves its start-up config connection pool unclosed (tests/tinker/test_sdk.py says more)
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _text(i: int) -> str:
    return f"Row {i}: the quick brown fox jumps over the lazy dog {i % 7} times, then rests. " * 2


def test_tinker_overhead(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TINKER_TELEMETRY": "0",
        "OMP_NUM_THREADS": "1",
        "TUNEHOUSE_BROKER_URL": WORKER_BROKER,
    }
    os.environ["TINKER_TELEMETRY"] = "0"
    url, server = start_server({"TUNEHOUSE_BROKER_URL": WORKER_BROKER, "OMP_NUM_THREADS": "1"})
    host = start_tinker_host(env)
    worker = subprocess.Popen(
        [sys.executable, "-m", "tunehouse.cli", "worker", "--loglevel", "warning"], env=env
    )
    try:
        key = new_key()
        service = tinker.ServiceClient(base_url=url, api_key=f"tml-{key}")
        training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=0).result()
        _overhead(url, key, training)
        _throughput(url, key, service)
    finally:
        _stop(worker)
        _stop(host)
        _stop(server)


def _overhead(url: str, key: str, training: tinker.TrainingClient) -> None:
    tokens = [5 + (3 * j) % 400 for j in range(TOKENS + 1)]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * TOKENS},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=training.model_id,
        seq_id=1,
    )
    proto = forward_backward_request_to_proto(request)
    proto.forward_only = True
    body = proto.SerializeToString()
    results = redis.Redis.from_url(os.environ["TUNEHOUSE_REDIS_URL"])
    headers = {"X-API-Key": f"tml-{key}"}
    walls, computes = [], []
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        for i in range(CALLS + 5):
            start = time.perf_counter()
            future = client.post(
                "/api/v1/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"}
            ).json()
            while True:
                answer = client.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]})
                if answer.headers["content-type"].startswith("application/x-protobuf"):
                    break
                assert answer.json().get("type") == "try_again", answer.text
            wall = time.perf_counter() - start
            if i >= 5:  # warm-up: the first calls load the model's code paths
                walls.append(wall)
                computes.append(
                    float(results.hget(channel.key("result", future["request_id"]), "compute_s") or 0)
                )
    overheads = sorted((w - c) * 1000 for w, c in zip(walls, computes, strict=True))
    sdk_walls = []
    for _ in range(CALLS // 2):
        start = time.perf_counter()
        training.forward([datum], "cross_entropy").result()
        sdk_walls.append((time.perf_counter() - start) * 1000)
    print(f"\nforward of one {TOKENS}-token datum, tiny model, {CALLS} calls over loopback")
    print("| | p50 ms | p90 ms |")
    print("| --- | --- | --- |")
    _row("host compute", [c * 1000 for c in computes])
    _row("raw HTTP wall", [w * 1000 for w in walls])
    _row("overhead (wall - compute, per call)", overheads)
    _row("SDK forward().result() wall", sdk_walls)


def _row(name: str, values: list[float]) -> None:
    ordered = sorted(values)
    print(f"| {name} | {statistics.median(ordered):.1f} | {ordered[int(0.9 * len(ordered))]:.1f} |")


def _throughput(url: str, key: str, service: tinker.ServiceClient) -> None:
    from transformers import AutoTokenizer

    from service.config import get_settings
    from worker.models import ensure_tiny_model

    rows = [{"text": _text(i)} for i in range(ROWS)]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        file_id = upload_ok(client, rows)
        method = {
            "type": "supervised",
            "supervised": {
                "hyperparameters": {"n_epochs": 1, "batch_size": BATCH, "lora": True, "lora_r": 8}
            },
        }
        job = client.post(
            "/v1/fine_tuning/jobs",
            json={"model": MODEL, "training_file": file_id, "method": method, "seed": 0},
        ).json()
        assert "id" in job, job
        while job["status"] not in ("succeeded", "failed", "cancelled"):
            time.sleep(0.5)
            job = client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
    assert job["status"] == "succeeded", job
    job_s = max(job["finished_at"] - job["started_at"], 1)
    job_tps = job["trained_tokens"] / job_s

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model(get_settings().models_dir / "tiny-llama"))
    data = []
    for row in rows:
        ids = [int(t) for t in tokenizer(row["text"])["input_ids"]]
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
        )
    tokens = sum(len(d.loss_fn_inputs["weights"].tolist()) for d in data)
    start = time.perf_counter()
    training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=0).result()
    for i in range(0, len(data), BATCH):
        fwd = training.forward_backward(data[i : i + BATCH], "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=1e-4))
        fwd.result()
        opt.result()
    loop_s = time.perf_counter() - start
    print(f"\nSFT, {ROWS} text rows x 1 epoch, batch {BATCH}, LoRA r=8, tiny model")
    print("| | trained tokens | s | tokens/s |")
    print("| --- | --- | --- | --- |")
    print(f"| tunehouse job (started_at..finished_at) | {job['trained_tokens']} | {job_s} | {job_tps:.0f} |")
    print(f"| Tinker SDK loop | {tokens} | {loop_s:.1f} | {tokens / loop_s:.0f} |")
    print(f"ratio Tinker / job: {(tokens / loop_s) / job_tps:.2f}")
