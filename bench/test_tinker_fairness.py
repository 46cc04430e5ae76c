"""The Tinker API between tenants: while one tenant floods the host with sample calls, how long another
tenant's one small call takes (issue 56).

    make bench TRAINER_BENCH=--skip ARGS="-k tinker_fairness -s"

A real uvicorn server and Tinker host on Redis, the tiny model. One tenant sends `FLOOD` calls at once
(4 samples of 48 tokens after a 200-token prompt, each), under the per-tenant cap (set to 100 here);
then another tenant sends one call of 2 tokens. Prints one flood call's time alone, the other tenant's
latency, and when the flood's last call finished after it. The "before" in docs/benchmarks.md is this
file run in a checkout of 0487303, the last commit with one first-in-first-out queue for all tenants
(`PYTHONPATH=<that checkout> pytest -s <this file>` from it).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import _stop, new_key, start_server
from tests.helpers import start_tinker_host

os.environ["TINKER_TELEMETRY"] = "0"
BASE = "tunehouse/tiny-llama"
FLOOD = 40


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    env = {"TUNEHOUSE_TINKER_MAX_QUEUED_CALLS": "100"}
    address, api = start_server(env)
    host = start_tinker_host({**os.environ, **env, "OMP_NUM_THREADS": "1"})
    yield address
    _stop(host)
    _stop(api)
    gc.collect()


def _sampler(url: str) -> tuple[str, str]:
    key = f"tml-{new_key()}"
    headers = {"X-API-Key": key}
    session = httpx.post(f"{url}/api/v1/create_session", json={}, headers=headers).json()["session_id"]
    body = {"session_id": session, "base_model": BASE}
    sampler = httpx.post(f"{url}/api/v1/create_sampling_session", json=body, headers=headers).json()
    return key, sampler["sampling_session_id"]


def _sample(url: str, key: str, sampler: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {
        "sampling_session_id": sampler,
        "num_samples": 4,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
        "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0},
    }
    return httpx.post(f"{url}/api/v1/asample", json=body, headers={"X-API-Key": key}, timeout=60)


def _wait(url: str, key: str, request_id: str) -> float:
    started = time.monotonic()
    while True:
        answer = httpx.post(
            f"{url}/api/v1/retrieve_future",
            json={"request_id": request_id},
            headers={"X-API-Key": key},
            timeout=120,
        )
        if answer.headers["content-type"].startswith("application/x-protobuf"):
            return time.monotonic() - started
        assert answer.json().get("type") == "try_again", answer.text


@pytest.mark.slow
def test_tinker_fairness(url: str) -> None:
    flooder, flood_sampler = _sampler(url)
    other, other_sampler = _sampler(url)
    prompt = [5 + j for j in range(200)]
    single = _wait(url, flooder, _sample(url, flooder, flood_sampler, prompt, 48).json()["request_id"])
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _sample(url, flooder, flood_sampler, prompt, 48), range(FLOOD)))
    queued = [a.json()["request_id"] for a in answers if a.status_code == 200]
    sent = time.monotonic()
    request = _sample(url, other, other_sampler, [5, 6], 2).json()["request_id"]
    _wait(url, other, request)
    other_latency = time.monotonic() - sent
    flood_left = _wait(url, flooder, queued[-1])
    print(
        f"\nFAIRNESS one flood call {single:.2f}s; other tenant's call {other_latency:.2f}s; "
        f"{len(queued)} queued; the flood's last call done {flood_left:.2f}s after the other was sent"
    )
