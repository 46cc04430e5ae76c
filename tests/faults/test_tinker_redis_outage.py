"""The Tinker host rides out Redis, and `tunehouse worker --tinker` starts it again when it dies.

A client of the official SDK trains while its stack's own redis-server is SIGSTOPped for 10 s (hung: the
host's reads time out and it backs off instead of exiting), then restarted without persistence (every
key gone: the session comes back from PostgreSQL, the host puts back its runs' live part). The client's
next calls succeed and train on the same adapter. Then the host process is SIGKILLed: the supervisor
starts a new one.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from service.tinker.channel import key
from tests.faults.servers import FaultStack

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
HUNG_SECONDS = 10.0
TOKENS = [5 + (7 * j) % 200 for j in range(12)]


def _hosts(client: redis.Redis) -> list[bytes]:
    return list(client.scan_iter(key("host", "*")))


def _wait_for(what: str, check: object, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_tinker_host_survives_a_hung_then_restarted_redis_and_its_own_death(fault_stack: FaultStack) -> None:
    url, _ = fault_stack.start_api()
    env = {**os.environ, **fault_stack.env(OMP_NUM_THREADS="1", TINKER_TELEMETRY="0")}
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "tunehouse.cli", "worker", "--tinker"], env=env, start_new_session=True
    )
    fault_stack.procs.append(supervisor)
    live = redis.Redis.from_url(f"{fault_stack.redis.url}/1", socket_timeout=5)
    _wait_for("the Tinker host did not start", lambda: _hosts(live))

    service = tinker.ServiceClient(base_url=url, api_key=f"tml-{fault_stack.new_key()}")
    training = service.create_lora_training_client(base_model="tunehouse/tiny-llama", rank=4, seed=0).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )

    def step(client: tinker.TrainingClient) -> float:
        out = client.forward_backward([datum], "cross_entropy").result(timeout=120)
        client.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=120)
        return float(out.metrics["loss:sum"])

    losses = [step(training) for _ in range(3)]
    host_pid = int(_hosts(live)[0].decode().split("-")[1])

    fault_stack.redis.freeze()
    time.sleep(HUNG_SECONDS)
    fault_stack.redis.thaw()
    fault_stack.redis.stop()  # and restarted empty: no persistence
    fault_stack.redis.start()
    live = redis.Redis.from_url(f"{fault_stack.redis.url}/1", socket_timeout=5)
    _wait_for("the host did not come back to Redis", lambda: _hosts(live), timeout=60)
    assert int(_hosts(live)[0].decode().split("-")[1]) == host_pid, (
        "the host restarted instead of riding it out"
    )

    losses += [step(training) for _ in range(3)]  # the same adapter trains on: its loss keeps falling
    assert losses[-1] < losses[2] < losses[0], losses
    assert training.save_state("after-outage").result(timeout=120).path.endswith("/weights/after-outage")

    os.kill(host_pid, signal.SIGKILL)  # the supervisor starts a new host
    _wait_for(
        "the supervisor did not start a new host",
        lambda: any(int(h.decode().split("-")[1]) != host_pid for h in _hosts(live)),
    )
    assert supervisor.poll() is None
    restored = service.create_training_client_from_state(
        "tinker://" + training.model_id + "/weights/after-outage"
    )
    assert restored.result(timeout=120).forward([datum], "cross_entropy").result(timeout=120)
    # the SDK's one-off start-up connection pool (tests/tinker/test_sdk.py says why): collected here,
    # under this module's warning filter, not during whichever test runs next in this process (a browser
    # test once failed on it)
    del service, training, restored
    gc.collect()
