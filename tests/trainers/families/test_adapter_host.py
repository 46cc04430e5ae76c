"""One base, several named LoRA adapters (trainers/families/adapter_host.py), in process on the tiny
model: each adapter learns alone, its state round-trips exactly, sampling and scoring agree."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainers.families.adapter_host import Adam, AdapterHost, AdapterSpec, HostError

TOKENS = [5, 9, 13, 17, 21, 25, 29, 33]
DATUM = (TOKENS[:-1], {"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})
ADAM = Adam(learning_rate=2e-2)


@pytest.fixture(scope="module")
def host(tiny_model_path: Path) -> Iterator[AdapterHost]:
    # one thread: the tiny model's matrices are too small to share out, and on a busy 2-core machine
    # two OpenMP threads waiting on each other made each step about 30 times slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield AdapterHost(str(tiny_model_path))
    torch.set_num_threads(threads)


def _loss(host: AdapterHost, name: str) -> float:
    _, metrics = host.forward_backward(name, [DATUM], loss_fn="cross_entropy", config={}, forward_only=True)
    return metrics["loss:sum"]


def _step(host: AdapterHost, name: str) -> None:
    host.forward_backward(name, [DATUM], loss_fn="cross_entropy", config={})
    host.optim_step(name, ADAM)


def test_adapters_on_one_base_train_apart(host: AdapterHost) -> None:
    host.create("run-a", AdapterSpec(rank=4, seed=0))
    host.create("run-b", AdapterSpec(rank=4, seed=0))
    start_a, start_b = _loss(host, "run-a"), _loss(host, "run-b")
    assert start_a == pytest.approx(start_b)  # same seed, LoRA B starts at zero: the base's loss
    # b's gradient waits in b while a trains; a's steps leave b untouched
    host.forward_backward("run-b", [DATUM], loss_fn="cross_entropy", config={})
    for _ in range(5):
        _step(host, "run-a")
    assert _loss(host, "run-a") < start_a
    assert _loss(host, "run-b") == pytest.approx(start_b)
    host.optim_step("run-b", ADAM)  # the pending gradient of b, alone
    after_b = _loss(host, "run-b")
    assert after_b < start_b and after_b > _loss(host, "run-a")


def test_state_round_trips_weights_and_optimizer_exactly(host: AdapterHost) -> None:
    host.create("run-c", AdapterSpec(rank=4, seed=1))
    for _ in range(2):
        _step(host, "run-c")
    saved = host.state("run-c")
    _step(host, "run-c")
    expected = _loss(host, "run-c")
    _step(host, "run-c")
    host.load_state("run-c", saved, optimizer=True)
    _step(host, "run-c")
    assert _loss(host, "run-c") == expected
    host.load_state("run-c", saved, optimizer=False)  # fresh moments: a different step
    _step(host, "run-c")
    assert _loss(host, "run-c") != expected
    host.load_state("run-d", saved, optimizer=True)  # a new adapter made from a state
    _step(host, "run-d")
    assert _loss(host, "run-d") == expected


def test_sampled_logprobs_are_the_policy_scores(host: AdapterHost) -> None:
    host.create("run-e", AdapterSpec(rank=4, seed=2))
    _step(host, "run-e")
    host.snapshot("run-e-snapshot", host.weights("run-e"), {"rank": 4})
    sampled = host.sample(
        "run-e-snapshot",
        TOKENS[:3],
        num_samples=2,
        max_tokens=4,
        temperature=1.0,
        top_p=1.0,
        stop_tokens=set(),
        seed=3,
    )
    for seq in sampled:
        full = TOKENS[:3] + seq.tokens
        outputs, _ = host.forward_backward(
            "run-e",
            [(full[:-1], {"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})],
            loss_fn="cross_entropy",
            config={},
            forward_only=True,
        )
        assert outputs[0]["logprobs"][2:] == pytest.approx(seq.logprobs, abs=1e-5)
    greedy = host.sample(
        None,
        TOKENS[:3],
        num_samples=1,
        max_tokens=3,
        temperature=0.0,
        top_p=1.0,
        stop_tokens=set(),
        seed=None,
    )
    with torch.no_grad():
        logits = host.base(input_ids=torch.tensor([TOKENS[:3]])).logits  # the base alone, adapters off
    assert greedy[0].tokens[0] == int(logits[0, -1].argmax())


def test_refuses_what_it_cannot_serve(host: AdapterHost) -> None:
    with pytest.raises(HostError, match="no training client"):
        host.optim_step("nobody", ADAM)
    host.create("run-f", AdapterSpec(rank=2))
    with pytest.raises(HostError, match="not a built-in loss"):
        host.forward_backward("run-f", [DATUM], loss_fn="dpo", config={})
    with pytest.raises(HostError, match="token ids are 0 to 511"):
        host.forward_backward(
            "run-f",
            [([5, 512], {"target_tokens": [512, 6], "weights": [1.0, 1.0]})],
            loss_fn="cross_entropy",
            config={},
        )
    with pytest.raises(HostError, match=r"loss_fn_inputs\.logprobs"):
        host.forward_backward("run-f", [DATUM], loss_fn="importance_sampling", config={})
