"""Multi-node jobs through the whole stack on a real two-node Ray cluster (tests/ray/cluster.py): an API
server and a Celery worker pointed at the cluster (`TUNEHOUSE_RAY_ADDRESS`) drive `resources.nodes: 2`
jobs as 2 Ray Train ranks, one on each node (gloo on CPU).

- SFT and DPO on 2 nodes give the loss curve of a one-node job with the same global batch
  (`batch_size x gradient_accumulation_steps x nodes x gpus_per_node`). Tolerance 1e-5 relative, as for
  2 ranks on one host (tests/multi_gpu/test_multi_gpu_jobs.py): the same per-token losses and gradients summed
  in another order (each rank its micro-batches, then gloo the partial sums); a wrong share of the batch
  or a wrong denominator moves the loss by more than 1e-2.
- Cancel reaches both ranks: the job ends `cancelled` and no Ray Train worker outlives it.
- A node whose raylet is killed mid-job: the run fails at the survivor's next collective, the job is
  requeued (a charged restart), waits for a node to join (the test starts a fresh one, as an autoscaler
  would) and resumes from its latest checkpoint; every step's metrics appear once, gap-free.
- No TCP connection of the cluster's processes leaves loopback (`ss -tanp`, sampled while jobs run).

Slow (a Ray cluster, Ray workers that import torch): its own CI step, `pytest tests/ray`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import _stop, new_key, redis_db, start_server
from tests.e2e.test_preference_methods import preference_rows
from tests.helpers import all_pages, chat_rows, upload_ok, wait_for
from tests.multi_gpu.test_multi_gpu_jobs import (
    CURVE,
    _assert_same_curve,
    _checkpoint_steps,
    _create,
    _method,
    _steps,
)
from tests.ray.cluster import HEAD_IP, RayCluster, pids_of

BROKER = redis_db(4)
QUEUE = "tunehouse-ray"


class Stack:
    def __init__(self, client: httpx.Client, cluster: RayCluster) -> None:
        self.client, self.cluster = client, cluster
        self.outside: list[str] = []
        self._watching = threading.Event()

    def watch_network(self) -> None:
        """Sample the cluster's connections every second until the module ends."""

        def loop() -> None:
            while not self._watching.wait(1.0):
                self.outside += self.cluster.outside_connections()

        threading.Thread(target=loop, daemon=True).start()

    def stop_watching(self) -> None:
        self._watching.set()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    """The cluster (head on 127.0.0.2, a worker node on 127.0.0.3, 1 CPU each), an API server and one
    training worker, on a broker and queue of their own."""
    import redis

    redis.Redis.from_url(BROKER).flushdb()
    cluster = RayCluster(Path(tempfile.mkdtemp(prefix="tunehouse-ray-")))
    env = {
        "TUNEHOUSE_BROKER_URL": BROKER,
        "TUNEHOUSE_JOB_QUEUE": QUEUE,
        "TUNEHOUSE_RAY_ADDRESS": cluster.address,
        "TUNEHOUSE_RAY_NODE_IP_ADDRESS": HEAD_IP,
        "TUNEHOUSE_RAY_RETRY_SECONDS": "5",
        # a dead peer fails the survivor's collective at once (gloo); a hung one within this
        "TUNEHOUSE_COLLECTIVE_TIMEOUT_SECONDS": "60",
        **cluster.env,
    }
    worker = server = None
    try:
        cluster.start_head()
        cluster.add_node()
        cluster.wait_nodes(2)
        url, server = start_server(env)
        worker = subprocess.Popen(
            [sys.executable, "-m", "tunehouse.cli", "worker", "--loglevel", "warning"],
            env={**os.environ, **env},
        )
        headers = {"Authorization": f"Bearer {new_key()}"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
            s = Stack(client, cluster)
            s.watch_network()
            yield s
            s.stop_watching()
            assert s.outside == [], "connections left loopback:\n" + "\n".join(s.outside)
    finally:
        for proc in (worker, server):
            if proc is not None:
                _stop(proc)
        cluster.stop()


def _events(client: httpx.Client, job_id: str) -> list[str]:
    return [e["message"] for e in all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/events")]


def _print_curves(name: str, two: list[dict[str, Any]], one: list[dict[str, Any]]) -> None:
    print(f"\n{name}: step, loss on 2 nodes, loss on 1 node")
    for a, b in zip(two, one, strict=True):
        print(f"  {a['step']:3d}  {a['loss']:.7f}  {b['loss']:.7f}")


def _run_pair(
    client: httpx.Client, kind: str, rows: list[dict[str, Any]], hp: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same training as 2 nodes x 1 rank x 2 micro-batches... and as 1 rank x 4: (2-node job,
    1-node job)."""
    train = upload_ok(client, rows)
    two = _create(
        client,
        {
            "training_file": train,
            "method": _method(kind, **hp, gradient_accumulation_steps=1),
            "resources": {"nodes": 2, "gpus_per_node": 1},
        },
    )
    one = _create(
        client, {"training_file": train, "method": _method(kind, **hp, gradient_accumulation_steps=2)}
    )
    batch = 2 * hp["batch_size"]
    assert two["resources"] == {
        "nodes": 2,
        "gpus_per_node": 1,
        "gpus": 2,
        "strategy": "ddp",
        "global_batch_size": batch,
    }
    assert one["resources"]["global_batch_size"] == batch and one["resources"]["nodes"] == 1
    done_two, done_one = wait_for(client, two["id"], timeout=400), wait_for(client, one["id"])
    assert done_two["status"] == "succeeded", (done_two, _events(client, two["id"]))
    assert done_one["status"] == "succeeded", done_one
    events = _events(client, two["id"])
    assert any(m.startswith("Job started on Ray cluster") and "2 nodes x 1 ranks" in m for m in events), (
        events
    )
    assert any(f"= {batch} examples per step" in m for m in events), events
    return done_two, done_one


def test_two_node_sft_job_matches_one_node_job(stack: Stack) -> None:
    client = stack.client
    # 10 rows of 2 = 5 micro-batches an epoch, 2 a step: the epoch's last step has one, on rank 0 only
    hp = {"n_epochs": 2, "batch_size": 2, "lora": False, "learning_rate": 1e-3, "save_steps": 2}
    two, one = _run_pair(client, "supervised", chat_rows(10), hp)
    curve_two, curve_one = _steps(client, two["id"]), _steps(client, one["id"])
    _print_curves("SFT", curve_two, curve_one)
    assert len(curve_two) == 6
    _assert_same_curve(curve_two, curve_one, CURVE)
    # rank 0 alone checkpoints: one set, at the same steps as the 1-node job's
    assert _checkpoint_steps(client, two["id"]) == _checkpoint_steps(client, one["id"])
    assert two["trained_tokens"] == one["trained_tokens"] > 0


def test_two_node_dpo_job_matches_one_node_job(stack: Stack) -> None:
    client = stack.client
    hp = {"n_epochs": 1, "batch_size": 2, "learning_rate": 5e-3, "beta": 0.1}
    two, one = _run_pair(client, "dpo", preference_rows(8), hp)
    curve_two, curve_one = _steps(client, two["id"]), _steps(client, one["id"])
    _print_curves("DPO", curve_two, curve_one)
    assert len(curve_two) == 2
    dpo = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
    _assert_same_curve(curve_two, curve_one, (*CURVE[:3], *dpo))


def _ray_ranks(cluster: RayCluster) -> set[int]:
    return {pid for pid in pids_of(str(cluster.root)) if "RayTrainWorker" in _cmdline(pid)}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _wait_step(client: httpx.Client, job_id: str, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["current_step"] < step:
        assert time.monotonic() < deadline, (f"{job_id} did not reach step {step}", _events(client, job_id))
        time.sleep(0.2)


LONG = {"n_epochs": 40, "batch_size": 2, "learning_rate": 1e-3}


def test_cancel_reaches_every_rank(stack: Stack) -> None:
    client = stack.client
    train = upload_ok(client, chat_rows(8))
    job = _create(
        client,
        {"training_file": train, "method": _method("supervised", **LONG), "resources": {"nodes": 2}},
    )
    _wait_step(client, job["id"], 2)
    assert client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel").status_code == 200
    done = wait_for(client, job["id"], timeout=60)
    assert done["status"] == "cancelled", done
    assert done["current_step"] < 4 * LONG["n_epochs"]
    deadline = time.monotonic() + 60
    while _ray_ranks(stack.cluster):  # Ray ends the run's workers once the driver is done
        assert time.monotonic() < deadline, "a rank outlived its cancelled job"
        time.sleep(0.5)


def test_a_killed_node_is_survived(stack: Stack) -> None:
    client, cluster = stack.client, stack.cluster
    train = upload_ok(client, chat_rows(8))
    epochs = 6  # LONG's values are floats to mypy: the int is kept apart for the step count below
    hp = {**LONG, "n_epochs": epochs, "save_steps": 2}
    job = _create(
        client, {"training_file": train, "method": _method("supervised", **hp), "resources": {"nodes": 2}}
    )
    job_id = job["id"]
    total = 2 * epochs  # 8 rows / 2 per micro-batch / 2 ranks a step
    deadline = time.monotonic() + 300
    while not _checkpoint_steps(client, job_id):
        assert time.monotonic() < deadline, ("no checkpoint was written", _events(client, job_id))
        time.sleep(0.1)
    # the worker node (rank 1: STRICT_SPREAD puts one rank on each node) dies
    killed_at = time.monotonic()
    cluster.kill_node(cluster.nodes[1])
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["current_step"] < total
    # the job waits for a node with room, and says so; then an autoscaler's replacement joins
    deadline = time.monotonic() + 180
    while not any(m.startswith("Waiting for nodes") for m in _events(client, job_id)):
        assert time.monotonic() < deadline, _events(client, job_id)
        time.sleep(0.2)
    cluster.add_node()
    resumed_step = None
    while resumed_step is None:
        events = _events(client, job_id)
        resumed = [m for m in events if m.startswith("Resuming from the checkpoint at step")]
        if resumed:
            resumed_step = int(resumed[0].rsplit(" ", 1)[1])
        assert time.monotonic() < deadline + 300, events
        time.sleep(0.2)
    _wait_step(client, job_id, resumed_step + 1)
    print(
        f"\nnode death to training again (a replacement node included): {time.monotonic() - killed_at:.1f} s"
    )

    done = wait_for(client, job_id, timeout=300)
    assert done["status"] == "succeeded", (done, _events(client, job_id))
    assert done["error"] is None
    events = _events(client, job_id)
    assert any(m.startswith("Job restarted (1 of") for m in events), events
    # every step's metrics once, gap-free: the steps after the checkpoint were trained again and their
    # rows replaced, not recorded twice
    assert [r["step"] for r in _steps(client, job_id)] == list(range(1, total + 1))
