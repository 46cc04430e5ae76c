"""The official `tinker` SDK (pinned in the dev extra) against a real uvicorn server and a real Tinker
host process (worker/tinker_host.py) over real Redis, on the tiny model: the loops researchers write,
unchanged. One server and one host for the module; the last test kills the host.
"""

from __future__ import annotations

import gc
import math
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.conftest import _stop, new_key, start_server
from tests.helpers import start_tinker_host

tinker = pytest.importorskip("tinker")  # the dev extra pins it; importorskip only names it if missing
from tinker import types  # noqa: E402

# the SDK opens a one-off connection pool for its start-up config call and never closes it: asyncio
# reports the transport when it is collected (the SDK's own code; nothing of ours is left open)
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
BASE = "tunehouse/tiny-llama"
os.environ["TINKER_TELEMETRY"] = "0"  # the SDK's background telemetry: the server keeps none
# a few fixed token sequences of the tiny model's 512-token vocabulary
SEQUENCES = [[5 + (7 * i + 3 * j) % 200 for j in range(12)] for i in range(4)]


@dataclass
class Server:
    url: str
    env: dict[str, str]
    host: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # one torch thread in the host: the tiny model's matrices are too small to share out, and on a busy
    # 2-core machine two OpenMP threads waiting on each other made each call about 30 times slower
    # clients idle for 2 s are saved and freed (TUNEHOUSE_TINKER_IDLE_SECONDS), so the gaps between the
    # tests' calls restore clients as well
    env = {
        **os.environ,
        "TINKER_TELEMETRY": "0",
        "OMP_NUM_THREADS": "1",
        "TUNEHOUSE_TINKER_IDLE_SECONDS": "2",
    }
    url, api = start_server({})
    state = Server(url=url, env=env, host=start_tinker_host(env))
    yield state
    _stop(state.host)
    _stop(api)
    # collect the SDK's unclosed transports here, under this module's warning filter, not in whichever
    # test of another module runs when the collector next passes
    gc.collect()


def _client(server: Server, key: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=server.url, api_key=f"tml-{key}")


@pytest.fixture(scope="module")
def service_key() -> str:
    return new_key()


@pytest.fixture(scope="module")
def service(server: Server, service_key: str) -> tinker.ServiceClient:
    return _client(server, service_key)


def _sft_datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _mean_nll(output: types.ForwardBackwardOutput, data: list[types.Datum]) -> float:
    total = weights = 0.0
    for out, datum in zip(output.loss_fn_outputs, data, strict=True):
        logprobs = out["logprobs"].tolist()
        w = datum.loss_fn_inputs["weights"].tolist()
        total -= sum(lp * wi for lp, wi in zip(logprobs, w, strict=True))
        weights += sum(w)
    return total / weights


ADAM = types.AdamParams(learning_rate=2e-2)


def step_then_forward_on(training: tinker.TrainingClient, data: list[types.Datum]) -> list[float]:
    """One training step, then the log-probs of `data` under the new weights."""
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(ADAM).result()
    outputs = training.forward(data, "cross_entropy").result().loss_fn_outputs
    return [v for o in outputs for v in o["logprobs"].tolist()]


def test_supervised_loop_loss_falls(service: tinker.ServiceClient) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    data = [_sft_datum(s) for s in SEQUENCES]
    losses = []
    for _ in range(20):
        fwd = training.forward_backward(data, "cross_entropy")
        opt = training.optim_step(ADAM)
        out = fwd.result()
        opt.result()
        losses.append(_mean_nll(out, data))
        # the server's loss:sum is the same sum the client computes from the returned log-probs
        assert out.metrics["loss:sum"] == pytest.approx(
            losses[-1] * sum(len(s) - 1 for s in SEQUENCES), rel=1e-4
        )
    assert losses[-1] < 0.5 * losses[0], losses


def test_state_round_trip_restores_weights_and_optimizer(service: tinker.ServiceClient) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    data = [_sft_datum(s) for s in SEQUENCES[:2]]
    for _ in range(3):
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(ADAM).result()
    path = training.save_state("three").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/three")

    def step_then_forward() -> list[float]:
        return step_then_forward_on(training, data)

    after_one = step_then_forward()
    # a new client from the state, with its optimizer: the same next step, bit for bit (Adam's moments
    # and step count came back exactly, not only the weights)
    restored = service.create_training_client_from_state_with_optimizer(path).result()
    assert step_then_forward_on(restored, data) == after_one
    # weights only: a fresh optimizer takes another first step
    fresh = service.create_training_client_from_state(path).result()
    assert step_then_forward_on(fresh, data) != after_one
    # the same into the running client (the SDK's deprecated in-place load)
    step_then_forward()
    with pytest.warns(FutureWarning, match="deprecated"):
        training.load_state_with_optimizer(path).result()
    assert step_then_forward() == after_one


def test_sampling_through_saved_sampler_weights(service: tinker.ServiceClient) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    training.forward_backward([_sft_datum(SEQUENCES[0])], "cross_entropy").result()
    training.optim_step(ADAM).result()
    saved = training.save_weights_for_sampler("s1").result()
    sampler = service.create_sampling_client(model_path=saved.path).result()
    prompt = types.ModelInput.from_ints(SEQUENCES[0][:4])
    params = types.SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7)
    response = sampler.sample(prompt=prompt, num_samples=3, sampling_params=params).result()
    assert len(response.sequences) == 3
    for seq in response.sequences:
        assert 1 <= len(seq.tokens) <= 6 and seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        assert seq.stop_reason == ("length" if len(seq.tokens) == 6 else "stop")
        # the sampler's log-probs are the trained policy's: the training client scores them the same
        full = SEQUENCES[0][:4] + list(seq.tokens)
        scored = (
            training.forward([_sft_datum(full)], "cross_entropy")
            .result()
            .loss_fn_outputs[0]["logprobs"]
            .tolist()
        )
        assert scored[3:] == pytest.approx(list(seq.logprobs), abs=1e-4)
    # a stop token ends a sequence, kept as its last token
    first = response.sequences[0].tokens[0]
    stopped = sampler.sample(
        prompt=prompt,
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, stop=[first]),
    ).result()
    assert stopped.sequences[0].tokens == [first] and stopped.sequences[0].stop_reason == "stop"
    # prompt log-probs: None for the first token, then one per prompt token
    scored_prompt = sampler.compute_logprobs(prompt).result()
    assert (
        scored_prompt[0] is None
        and len(scored_prompt) == 4
        and all(v is not None and v < 0 for v in scored_prompt[1:])
    )


def test_rl_step_with_importance_sampling(service: tinker.ServiceClient) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = SEQUENCES[1][:4]
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=11)
    seqs = (
        sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=4, sampling_params=params)
        .result()
        .sequences
    )
    rewards = [1.0 if i % 2 == 0 else -1.0 for i in range(len(seqs))]
    data = []
    for seq, advantage in zip(seqs, rewards, strict=True):
        tokens = prompt + list(seq.tokens)
        n_prompt = len(prompt) - 1
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [0.0] * n_prompt + list(seq.logprobs or []),
                    "advantages": [0.0] * n_prompt + [advantage] * len(seq.tokens),
                },
            )
        )

    def sampled_logprob_sums() -> list[float]:
        outs = training.forward(data, "importance_sampling").result().loss_fn_outputs
        return [sum(o["logprobs"].tolist()[len(prompt) - 1 :]) for o in outs]

    before = sampled_logprob_sums()
    out = training.forward_backward(data, "importance_sampling").result()
    # at the sampling weights the ratio is 1: the loss is minus the sum of the advantages over tokens
    assert out.metrics["loss:sum"] == pytest.approx(
        -sum(a * len(s.tokens) for a, s in zip(rewards, seqs, strict=True)), abs=1e-3
    )
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = sampled_logprob_sums()
    for advantage, b, a in zip(rewards, before, after, strict=True):
        assert (a > b) if advantage > 0 else (a < b), (rewards, before, after)
    ppo = training.forward_backward(
        data, "ppo", loss_fn_config={"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    ).result()
    assert math.isfinite(ppo.metrics["loss:sum"])


def test_an_idle_client_is_saved_freed_and_restored_as_it_was(
    server: Server, service: tinker.ServiceClient
) -> None:
    import redis

    from service.tinker.channel import key

    data = [_sft_datum(SEQUENCES[3])]
    idle = service.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    twin = service.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    for client in (idle, twin):
        step_then_forward_on(client, data)
    pending = twin.forward_backward(data, "cross_entropy")  # a gradient waits: the twin stays
    pending.result()
    runs = redis.Redis.from_url(server.env["TUNEHOUSE_REDIS_URL"])
    deadline = time.monotonic() + 30
    while not runs.hexists(key("model", idle.model_id), "evicted_at"):
        assert time.monotonic() < deadline, "the idle client was not saved and freed"
        time.sleep(0.2)
    assert not runs.hexists(key("model", twin.model_id), "evicted_at")
    # the idle one comes back with its weights and Adam state: its next step is the twin's exactly
    after_idle = step_then_forward_on(idle, data)
    twin.optim_step(ADAM).result()
    assert after_idle == [
        v
        for o in twin.forward(data, "cross_entropy").result().loss_fn_outputs
        for v in o["logprobs"].tolist()
    ]
    assert not runs.hexists(key("model", idle.model_id), "evicted_at")
    runs.close()


def test_two_tenants_are_kept_apart(server: Server, service: tinker.ServiceClient, service_key: str) -> None:
    mine = service.create_lora_training_client(base_model=BASE, rank=4).result()
    path = mine.save_state("mine").result().path
    other_key = new_key()
    other = _client(server, other_key)
    with pytest.raises(tinker.NotFoundError, match="No training run"):
        other.create_training_client_from_state(path).result()
    rest = tinker.RestClient(base_url=server.url, api_key=f"tml-{other_key}")
    assert rest.list_training_runs().result().training_runs == []
    with pytest.raises(tinker.NotFoundError):
        rest.list_checkpoints(mine.model_id).result()
    mine_rest = tinker.RestClient(base_url=server.url, api_key=f"tml-{service_key}")
    runs = mine_rest.list_training_runs(limit=100).result().training_runs
    assert mine.model_id in [r.training_run_id for r in runs]
    assert [c.tinker_path for c in mine_rest.list_checkpoints(mine.model_id).result().checkpoints] == [path]
    # raw HTTP: another tenant's training run is a 404, a key without tml- still authenticates, none is 401
    key = new_key()
    answer = httpx.post(
        f"{server.url}/api/v1/get_info", json={"model_id": mine.model_id}, headers={"X-API-Key": f"tml-{key}"}
    )
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "model_id"
    assert httpx.post(f"{server.url}/api/v1/get_info", json={"model_id": "x"}).status_code == 401


def test_unsupported_parts_answer_clearly(server: Server, service: tinker.ServiceClient) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="custom losses are not supported"):
        training.forward_backward([_sft_datum(SEQUENCES[0])], "cross_entropy_v9").result()
    key = f"tml-{new_key()}"
    answer = httpx.post(f"{server.url}/api/v1/create_custom_loss", json={}, headers={"X-API-Key": key})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "tinker_unsupported"


def test_killed_worker_fails_inflight_calls_and_loses_unsaved_state(
    server: Server, service: tinker.ServiceClient
) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=4).result()
    data = [_sft_datum(SEQUENCES[2])]
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(ADAM).result()
    path = training.save_state("before-kill").result().path
    saved = training.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(ADAM).result()  # this step was never saved
    server.host.send_signal(signal.SIGSTOP)  # frozen: the next call is taken by nobody...
    inflight = training.forward_backward(data, "cross_entropy")
    time.sleep(0.5)
    server.host.kill()  # ...and the host dies with it queued
    server.host.wait()
    with pytest.raises(tinker.RequestFailedError, match="stopped before it finished"):
        inflight.result(timeout=60)
    # the client is gone; a new host serves a client made from the last saved state
    server.host = start_tinker_host(server.env)
    with pytest.raises(tinker.APIStatusError, match="create_training_client_from_state") as lost:
        training.forward(data, "cross_entropy").result()
    assert lost.value.status_code == 410
    restored = service.create_training_client_from_state(path).result()
    again = restored.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert again == saved
