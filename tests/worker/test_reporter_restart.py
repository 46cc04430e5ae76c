"""A run resumed from a checkpoint re-runs the steps after it: the metric rows are rewritten in place
and no "Step N" event, nor "Epoch N/M completed" event, is written twice (live streams and event lists
would show the step or the epoch twice; issue 46 found "Epoch 2/8 completed at step 128" twice on jobs
restarted after a PostgreSQL outage and after trainer kills)."""

from __future__ import annotations

import time
from pathlib import Path

from sqlalchemy import select

from service.config import get_settings
from service.db import session_scope
from service.ids import new_id
from service.models import Job, JobEvent, JobMetric, Tenant
from service.storage import LocalBlobStore
from worker.reporter import JobReporter


def _reporter(job_id: str, tmp_path: Path) -> JobReporter:
    return JobReporter(
        job_id=job_id,
        tenant_id="tenant-reporter",
        worker_id="w",
        fine_tuned_model="ft:x",
        # flushed only when the test says (a timed flush between a step and its evaluation would
        # make the evaluation an event of its own)
        settings=get_settings().model_copy(update={"metrics_flush_seconds": 3600.0}),
        blobs=LocalBlobStore(tmp_path),
    )


def _running_job() -> str:
    job_id = new_id("ftjob")
    with session_scope() as session:
        if session.get(Tenant, "tenant-reporter") is None:
            session.add(Tenant(id="tenant-reporter", name="reporter-test"))
            session.flush()
        # a heartbeat far ahead: no reconciler of another test's worker takes this job for stale
        session.add(
            Job(
                id=job_id,
                tenant_id="tenant-reporter",
                model="m",
                training_file="f",
                method={"type": "supervised"},
                seed=0,
                status="running",
                worker_id="w",
                heartbeat_at=time.time() + 10**6,
            )
        )
    return job_id


def test_steps_rerun_after_a_restart_get_no_second_event(tmp_path: Path) -> None:
    job_id = _running_job()

    def run(steps: range) -> None:
        reporter = _reporter(job_id, tmp_path)
        for step in steps:
            reporter.on_step({"step": float(step), "epoch": 0.0, "loss": 1.0 / step})
        reporter.on_eval({"step": float(steps[-1]), "epoch": 0.0, "valid_loss": 0.5})  # joins its step
        reporter.flush()

    run(range(1, 6))  # killed after step 5 was flushed; its last checkpoint was at step 3
    run(range(4, 9))  # the restarted run re-runs 4 and 5
    with session_scope() as session:
        events = session.scalars(
            select(JobEvent)
            .where(JobEvent.job_id == job_id, JobEvent.type == "metrics")
            .order_by(JobEvent.seq)
        )
        steps = [e.data["step"] for e in events if e.data]
        rows = session.scalars(select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.step))
        metrics = {m.step: m.values for m in rows}
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]
    assert sorted(metrics) == list(range(1, 9))
    # beside the step's own values, when it was logged and the trainer's memory (worker/devices.py)
    assert metrics[5] == {
        "loss": 0.2,
        "logged_at": metrics[5]["logged_at"],
        "rss_bytes": metrics[5]["rss_bytes"],
        "valid_loss": 0.5,
    }
    assert metrics[5]["rss_bytes"] > 10 * 2**20


def test_an_epoch_end_lived_again_after_a_restart_gets_no_second_event(tmp_path: Path) -> None:
    """2 epochs of 4 steps. The first run ends epoch 1 at step 4 and is killed after step 6; its last
    checkpoint was at step 3, so the restarted run ends epoch 1 at step 4 again, then epoch 2."""
    job_id = _running_job()

    def run(steps: range, epoch_ends: dict[int, int], *, retried: bool = False) -> None:
        reporter = _reporter(job_id, tmp_path)
        reporter.on_train_begin(total_steps=8, n_epochs=2)
        for step in steps:
            reporter.on_step({"step": float(step), "epoch": (step - 1) / 4, "loss": 1.0 / step})
            if step in epoch_ends:
                reporter.on_epoch_end(epoch=epoch_ends[step], step=step)
                if retried:  # a write retried after its commit's answer was lost (worker/outage.py)
                    reporter.on_epoch_end(epoch=epoch_ends[step], step=step)
        reporter.flush()

    run(range(1, 7), {4: 1})
    run(range(4, 9), {4: 1, 8: 2}, retried=True)
    with session_scope() as session:
        events = session.scalars(
            select(JobEvent.message)
            .where(JobEvent.job_id == job_id, JobEvent.message.startswith("Epoch"))
            .order_by(JobEvent.seq)
        )
        assert list(events) == ["Epoch 1/2 completed at step 4", "Epoch 2/2 completed at step 8"]
