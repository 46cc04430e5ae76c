"""A multi-node job's driver: `python -m worker.ray_driver JOB_ID WORKER_ID`, which the supervisor starts
in place of a trainer process for a job of `resources.nodes` > 1 (worker/supervisor.py keeps the lease
and heartbeats while it lives, exactly as for a trainer).

It connects to the operator's Ray cluster (`TUNEHOUSE_RAY_ADDRESS`) and runs a Ray Train `TorchTrainer`
of `nodes x gpus_per_node` ranks (one Ray worker each, `use_gpu` when the cluster has GPUs) whose
training function is our rank's entry point (worker/ray_rank.py): rank 0 reports and records the
outcome as a one-host job's rank 0 does. The ranks are spread over the nodes by the trainer's placement
group: `STRICT_SPREAD` (one rank per node) when `gpus_per_node` is 1, else `SPREAD`.

Failures: Ray Train's `FailureConfig(max_failures=0)`, so a rank that dies (its node lost) ends the run
and this process exits 1; the supervisor then requeues the job as a charged restart (worker/recovery.py)
and it resumes from its latest checkpoint in the blob store, on whatever nodes the cluster has then. Our
requeue rather than Ray's retry: the restart is counted against `max_restarts`, said in the job's events,
and runs the one resume path every other crash takes (the metrics after the checkpoint are replaced,
never recorded twice). A collective with a dead or hung peer fails within the job's collective timeout.

What the job waits for, and says so in its events:
- an unreachable cluster: retried for `ray_retry_seconds`, then the job goes back to the queue (never a
  failure: it is the deployment's fault, not the user's);
- a cluster with fewer nodes that can hold `gpus_per_node` ranks than the job asks for: it waits up to
  `ray_wait_seconds` for nodes to join (an autoscaler, an operator), then goes back to the queue. It is
  not refused at creation: a Ray cluster's size is not known to the API and changes.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from service.config import Settings, get_settings
from service.db import session_scope
from service.jobs import repository
from service.jobs.events import add_event
from service.jobs.resources import Resources, global_batch_size, job_resources
from worker.ray_rank import train_rank
from worker.recovery import hand_back

log = logging.getLogger("tunehouse.worker")

# how often the driver looks at the cluster again while it waits for nodes or for the cluster itself
POLL_SECONDS = 2.0
WAITING_KIND = "job.waiting_for_nodes"


def connect(settings: Settings) -> None:
    """Join the cluster as a driver; the ranks get this process's `TUNEHOUSE_*` settings."""
    assert settings.ray_address is not None
    env = {k: v for k, v in os.environ.items() if k.startswith("TUNEHOUSE_")}
    ray.init(
        address=settings.ray_address,
        _node_ip_address=settings.ray_node_ip_address,
        runtime_env={"env_vars": env},
        log_to_driver=True,
        logging_level=logging.WARNING,
    )


def nodes_with_room(need: Resources, *, use_gpu: bool, cpus_per_rank: float) -> int:
    """Live nodes that can hold `gpus_per_node` ranks (by their total resources, not what is free now:
    a busy node frees up, a small one never fits)."""
    count = 0
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        if not node.get("Alive"):
            continue
        resources = node.get("Resources", {})
        cpus_ok = resources.get("CPU", 0) >= cpus_per_rank * need.per_node
        gpus_ok = not use_gpu or resources.get("GPU", 0) >= need.per_node
        count += int(cpus_ok and gpus_ok)
    return count


def _event(job_id: str, message: str, *, level: str = "info", data: dict[str, Any] | None = None) -> None:
    with session_scope() as session:
        add_event(session, job_id, message, level=level, data=data)


def _hand_back(job_id: str, worker_id: str, why: str) -> None:
    with session_scope() as session:
        hand_back(session, job_id=job_id, worker_id=worker_id, why=why)


def _connect_retrying(job_id: str, worker_id: str, settings: Settings) -> bool:
    deadline = time.monotonic() + settings.ray_retry_seconds
    while True:
        try:
            connect(settings)
            return True
        except Exception as exc:  # ConnectionError, a timeout, an auth refusal: all the cluster's side
            if time.monotonic() >= deadline:
                _hand_back(
                    job_id,
                    worker_id,
                    f"the Ray cluster at {settings.ray_address} is unreachable ({type(exc).__name__}: "
                    f"{exc}); the job waits in the queue for it",
                )
                return False
            log.warning("job %s: Ray cluster unreachable, retrying: %s", job_id, exc)
            time.sleep(POLL_SECONDS)


def _wait_for_room(job_id: str, worker_id: str, need: Resources, settings: Settings, use_gpu: bool) -> bool:
    deadline = time.monotonic() + settings.ray_wait_seconds
    said = False
    cpus = settings.ray_cpus_per_rank
    what = f"{need.per_node} GPU(s)" if use_gpu else f"{cpus * need.per_node:g} CPU(s)"
    while (have := nodes_with_room(need, use_gpu=use_gpu, cpus_per_rank=cpus)) < need.nodes:
        why = (
            f"the Ray cluster has {have} live node(s) with {what} for {need.per_node} rank(s); "
            f"the job needs {need.nodes}"
        )
        if time.monotonic() >= deadline:
            _hand_back(job_id, worker_id, f"{why}; it waits in the queue for nodes to join")
            return False
        if not said:
            _event(
                job_id,
                f"Waiting for nodes: {why}",
                level="warning",
                data={"kind": WAITING_KIND, "nodes": need.nodes, "nodes_with_room": have},
            )
            said = True
        time.sleep(POLL_SECONDS)
    return True


def trainer_for(
    job_id: str, worker_id: str, need: Resources, settings: Settings, *, use_gpu: bool, attempt: int
) -> TorchTrainer:
    per_rank = {"CPU": settings.ray_cpus_per_rank, **({"GPU": 1} if use_gpu else {})}
    return TorchTrainer(
        train_rank,
        train_loop_config={"job_id": job_id, "worker_id": worker_id},
        scaling_config=ScalingConfig(
            num_workers=need.ranks,
            use_gpu=use_gpu,
            resources_per_worker=per_rank,
            placement_strategy="STRICT_SPREAD" if need.per_node == 1 else "SPREAD",
        ),
        torch_config=TorchConfig(
            backend="nccl" if use_gpu else "gloo",
            timeout_s=max(1, round(settings.collective_timeout_seconds)),
        ),
        run_config=RunConfig(
            # our checkpoints go to the blob store (rank 0); Ray keeps only its run's own records here
            name=f"{job_id}-attempt{attempt}",
            storage_path=str(Path(settings.data_dir) / "ray"),
            failure_config=FailureConfig(max_failures=0),
        ),
    )


def drive(job_id: str, worker_id: str) -> int:
    """Run the job's ranks on the cluster; the exit code (0: the outcome is recorded or the job handed
    back; 1: a rank or node died, the supervisor restarts it from its latest checkpoint)."""
    settings = get_settings()
    with session_scope() as session:
        job = repository.job(session, job_id)
        assert job is not None
        attempt = job.attempts or 0
        need = job_resources(job.resources)
        method_type = job.method["type"]
        hp = dict(job.method.get(method_type, {}).get("hyperparameters", {}))
    if not _connect_retrying(job_id, worker_id, settings):
        return 0
    try:
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0  # type: ignore[no-untyped-call]
        if not _wait_for_room(job_id, worker_id, need, settings, use_gpu):
            return 0
        batch = global_batch_size(hp, need.ranks)
        _event(
            job_id,
            f"Training on {need.nodes} nodes x {need.per_node} rank(s) = {need.ranks} ranks through Ray "
            f"Train ({'NCCL' if use_gpu else 'gloo'}); global batch = batch_size {hp.get('batch_size')} x "
            f"gradient_accumulation_steps {hp.get('gradient_accumulation_steps', 1)} x {need.ranks} ranks "
            f"= {batch} examples per step",
            data={
                "kind": "job.ray_ranks",
                "nodes": need.nodes,
                "ranks": need.ranks,
                "global_batch_size": batch,
            },
        )
        trainer = trainer_for(job_id, worker_id, need, settings, use_gpu=use_gpu, attempt=attempt)
        try:
            trainer.fit()
        except Exception as exc:  # a rank failed: a lost node, a collective that timed out, a crash
            log.error("job %s: the Ray Train run failed: %s", job_id, exc)
            return 1
        return 0
    finally:
        ray.shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(drive(sys.argv[1], sys.argv[2]))
