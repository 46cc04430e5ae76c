"""The Tinker API between tenants: while one tenant floods the host with sample calls, how long another
tenant's one small call takes (issue 56).

    make bench TRAINER_BENCH=--skip ARGS="-k tinker_fairness -s"

A real uvicorn server and Tinker host on Redis, the tiny model. One tenant sends `FLOOD` calls at once
(4 samples of 48 tokens after a 200-token prompt, each), under the per-tenant cap (set to 100 here);
then another tenant sends one call of 2 tokens. Prints one flood call's time alone, the other tenant's
latency, and when the flood's last call finished after it. The "before" in docs/benchmarks.md is this
file run in a checkout of 0487303, the last commit with one first-in-first-out queue for all tenants
(copy this file and tests/tinker/sampling.py into it; `pytest -s` this file from there).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import _stop, start_server
from tests.helpers import start_tinker_host
from tests.tinker.sampling import new_sampler, sample, wait

os.environ["TINKER_TELEMETRY"] = "0"
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


@pytest.mark.slow
def test_tinker_fairness(url: str) -> None:
    flooder, flood_sampler = new_sampler(url)
    other, other_sampler = new_sampler(url)
    prompt = [5 + j for j in range(200)]
    single = wait(url, flooder, sample(url, flooder, flood_sampler, prompt, 48).json()["request_id"])
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: sample(url, flooder, flood_sampler, prompt, 48), range(FLOOD)))
    queued = [a.json()["request_id"] for a in answers if a.status_code == 200]
    sent = time.monotonic()
    request = sample(url, other, other_sampler, [5, 6], 2).json()["request_id"]
    wait(url, other, request)
    other_latency = time.monotonic() - sent
    flood_left = wait(url, flooder, queued[-1])
    print(
        f"\nFAIRNESS one flood call {single:.2f}s; other tenant's call {other_latency:.2f}s; "
        f"{len(queued)} queued; the flood's last call done {flood_left:.2f}s after the other was sent"
    )
