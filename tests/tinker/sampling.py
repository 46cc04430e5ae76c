"""Raw Tinker sample calls as the SDK sends them, for tests/tinker/test_fairness.py and
bench/test_tinker_fairness.py: a tenant's sampling session, an `asample` call, and waiting out its future."""

from __future__ import annotations

import time

import httpx

from tests.conftest import new_key

BASE = "tunehouse/tiny-llama"


def new_sampler(url: str) -> tuple[str, str]:
    """(api key, sampling session id) of a new tenant sampling the base model."""
    key = f"tml-{new_key()}"
    headers = {"X-API-Key": key}
    session = httpx.post(f"{url}/api/v1/create_session", json={}, headers=headers).json()["session_id"]
    body = {"session_id": session, "base_model": BASE}
    sampler = httpx.post(f"{url}/api/v1/create_sampling_session", json=body, headers=headers).json()
    return key, sampler["sampling_session_id"]


def sample(url: str, key: str, sampler: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    """An `asample` call of 4 samples; its answer holds the request id of its future."""
    body = {
        "sampling_session_id": sampler,
        "num_samples": 4,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
        "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0},
    }
    return httpx.post(f"{url}/api/v1/asample", json=body, headers={"X-API-Key": key}, timeout=60)


def wait(url: str, key: str, request_id: str) -> float:
    """Seconds until the future's result arrives."""
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
