"""One tenant cannot stall another on the Tinker API (issue 56): calls are taken round-robin between
tenants (service/tinker/channel.py), a tenant's waiting calls are capped (429 with Retry-After), a
sample must fit the model's context (400 naming `prompt`), and NaN/inf inputs or absurd optimizer
parameters are refused (400) before they reach the host. A real server and host on the tiny model.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import _stop, start_server
from tests.helpers import start_tinker_host
from tests.tinker.sampling import BASE, new_sampler, sample, wait

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
os.environ["TINKER_TELEMETRY"] = "0"
CAP = 40
FLOOD = 60  # calls one tenant sends at once: past the cap, so some answer 429


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    env = {"TUNEHOUSE_TINKER_MAX_QUEUED_CALLS": str(CAP)}
    address, api = start_server(env)
    host = start_tinker_host({**os.environ, **env, "OMP_NUM_THREADS": "1"})
    yield address
    _stop(host)
    _stop(api)
    gc.collect()


def test_a_flooding_tenant_waits_behind_another_tenants_call(url: str) -> None:
    flooder, flood_sampler = new_sampler(url)
    other, other_sampler = new_sampler(url)
    prompt = [5 + j for j in range(200)]
    # one flood call alone: how long one call's compute takes here
    single = wait(url, flooder, sample(url, flooder, flood_sampler, prompt, 48).json()["request_id"])
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: sample(url, flooder, flood_sampler, prompt, 48), range(FLOOD)))
    queued = [a.json()["request_id"] for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    # the host takes calls while they arrive, so a few more than CAP get in; the rest wait at the sender
    assert len(queued) >= CAP and refused and len(queued) + len(refused) == FLOOD, [
        a.status_code for a in answers
    ]
    assert (
        refused[0].headers["retry-after"] == "1" and refused[0].json()["error"]["code"] == "tinker_queue_full"
    )
    # the other tenant's small call is taken next, not after the CAP calls queued before it
    sent = time.monotonic()
    request = sample(url, other, other_sampler, [5, 6], 2).json()["request_id"]
    wait(url, other, request)
    other_latency = time.monotonic() - sent
    flood_left = wait(url, flooder, queued[-1])  # the flood's last call: it finishes after the other's
    print(f"one flood call {single:.2f}s; another tenant's call {other_latency:.2f}s, {len(queued)} queued")
    assert other_latency < 3 * single + 1.0 < flood_left, (single, other_latency, flood_left)


def test_a_sample_must_fit_the_context_and_inputs_must_be_finite(url: str) -> None:
    key, sampler = new_sampler(url)
    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model=BASE, rank=4).result()  # loads the base
    too_long = sample(url, key, sampler, [5] * 2040, 16)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt", too_long.text
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, math.nan, 1.0]},
    )
    with pytest.raises(tinker.BadRequestError, match="NaN and infinite"):
        training.forward_backward([datum], "cross_entropy").result()
    for absurd in ({"learning_rate": 1e308}, {"learning_rate": 1e-3, "eps": 0.0}):
        answer = httpx.post(
            f"{url}/api/v1/optim_step",
            json={"model_id": training.model_id, "adam_params": absurd},
            headers={"X-API-Key": key},
        )
        assert answer.status_code == 400, answer.text
    answer = httpx.post(
        f"{url}/api/v1/optim_step",
        content=b'{"model_id": "%s", "adam_params": {"learning_rate": Infinity}}'
        % training.model_id.encode(),
        headers={"X-API-Key": key, "content-type": "application/json"},
    )
    assert answer.status_code == 400, answer.text
