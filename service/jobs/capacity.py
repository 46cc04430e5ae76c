"""Which live workers can run what: each training worker advertises its GPUs, so a job that no live
worker can hold says so in its events instead of waiting in silence.

A worker writes its row (`advertise`) when it starts and at every reconciler pass, and removes it when
it stops (`retire`); a row not re-written for a lease timeout belongs to a dead worker. The row only
informs: routing itself is by queue (service/jobs/resources.py), so a worker that joins later picks
the job up with no further step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from service.jobs import repository
from service.jobs.events import add_event
from service.jobs.resources import job_resources
from service.models import Job, JobEvent, Worker

WAITING_KIND = "job.waiting_for_worker"


@dataclass(frozen=True)
class DeviceInfo:
    """One device of a worker: "cuda" or "cpu", its name, its memory in bytes (None: unknown)."""

    kind: str = "cpu"
    name: str | None = None
    memory_bytes: int | None = None

    def describe(self) -> str:
        """What a job's event says it runs on.

        >>> DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", 80 * 2**30).describe()
        'cuda: NVIDIA H100 80GB HBM3, 80.0 GiB'
        >>> DeviceInfo("cpu", "x86_64", 16 * 2**30).describe()
        'cpu: x86_64, 16.0 GiB RAM'
        """
        memory = "" if self.memory_bytes is None else f", {self.memory_bytes / 2**30:.1f} GiB"
        if memory and self.kind == "cpu":
            memory += " RAM"
        return f"{self.kind}: {self.name or 'unknown'}{memory}"


def advertise(
    session: Session,
    *,
    worker_id: str,
    queue: str,
    gpus: int,
    device: DeviceInfo | None = None,
    stats: dict[str, Any] | None = None,
) -> None:
    """Write the worker's row; `stats`: its devices' live figures (worker/devices.py), for the workers
    page and Prometheus."""
    device = device or DeviceInfo()
    row = session.get(Worker, worker_id)
    if row is None:
        row = Worker(id=worker_id)
        session.add(row)
    row.queue, row.gpus, row.seen_at = queue, gpus, time.time()
    row.device, row.device_name, row.device_memory_bytes = device.kind, device.name, device.memory_bytes
    row.stats = stats


def retire(session: Session, *, worker_id: str) -> None:
    session.execute(delete(Worker).where(Worker.id == worker_id))


def largest_live(session: Session, *, queue: str, within: float) -> int | None:
    """The most GPUs a worker of the `queue` pool seen in the last `within` seconds has; None if none."""
    cutoff = time.time() - within
    most = session.scalar(
        select(func.max(Worker.gpus)).where(Worker.queue == queue, Worker.seen_at >= cutoff)
    )
    return None if most is None else int(most)


def note_if_unfit(session: Session, job: Job, *, base_queue: str, within: float) -> bool:
    """Add the job's "waiting for a worker" event (once) if no live worker of its pool has the GPUs it
    asks for; True if the job fits no live worker. One-GPU jobs fit every worker and are not checked;
    multi-node jobs wait for their Ray cluster's nodes, which the driver reports."""
    resources = job_resources(job.resources)
    gpus = resources.per_node
    if gpus == 1 or resources.multi_node:  # a multi-node job's cluster is Ray's (worker/ray_driver.py)
        return False
    largest = largest_live(session, queue=base_queue, within=within)
    if largest is not None and largest >= gpus:
        return False
    noted = session.scalar(
        select(func.count())
        .select_from(JobEvent)
        .where(JobEvent.job_id == job.id, JobEvent.data["kind"].as_string() == WAITING_KIND)
    )
    if not noted:
        have = (
            "no training worker is running" if largest is None else f"the largest live worker has {largest}"
        )
        add_event(
            session,
            job.id,
            f"Waiting for a worker with {gpus} GPUs: {have}; the job stays queued until one joins",
            level="warning",
            data={"kind": WAITING_KIND, "status": "queued", "gpus": gpus, "largest_worker_gpus": largest},
        )
    return True


def note_unfit_jobs(session: Session, *, base_queue: str, within: float) -> list[str]:
    """`note_if_unfit` for every queued multi-GPU job of the pool (the reconciler's pass: a worker that
    left may have been the only one big enough)."""
    jobs = repository.queued_on_gpu_queues(session, base_queue)
    return [job.id for job in jobs if note_if_unfit(session, job, base_queue=base_queue, within=within)]
