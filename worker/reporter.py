"""The trainer's callbacks for a job: metrics, events, checkpoints and cancel checks, into the DB.

Metric rows are buffered and flushed to the DB at least every `metrics_flush_seconds` (and at every
event that matters), so a fast loop does not pay a DB round trip per step; each row is also published
on Redis (`tunehouse:job:<id>`) the moment it is logged, when Redis is configured, for live streams.
"""

from __future__ import annotations

import json
import logging
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from service.config import Settings
from service.db import session_scope
from service.ids import new_id
from service.jobs.events import add_event
from service.jobs.stream import channel
from service.models import Checkpoint, Job, JobMetric
from service.storage import LocalBlobStore
from trainers.loop import CheckpointInfo, StopRequest

log = logging.getLogger("tunehouse.worker")

# the keys OpenAI's checkpoint objects carry, mapped from our step rows
_CHECKPOINT_METRICS = {
    "loss": "train_loss",
    "mean_token_accuracy": "train_mean_token_accuracy",
    "valid_loss": "valid_loss",
    "valid_mean_token_accuracy": "valid_mean_token_accuracy",
}


def tar_folder(folder: Path, dest: Path) -> int:
    with tarfile.open(dest, "w") as tar:
        for path in sorted(folder.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    return dest.stat().st_size


class JobReporter:
    def __init__(
        self,
        *,
        job_id: str,
        tenant_id: str,
        worker_id: str,
        fine_tuned_model: str,
        settings: Settings,
        blobs: LocalBlobStore,
        publisher: Any | None = None,
    ) -> None:
        self.job_id = job_id
        self.tenant_id = tenant_id
        self.worker_id = worker_id
        self.fine_tuned_model = fine_tuned_model
        self.settings = settings
        self.blobs = blobs
        self.publisher = publisher
        self.total_steps: int | None = None
        self.n_epochs = 1
        self.last_row: dict[str, float] = {}
        self.final_checkpoint_id: str | None = None
        self._pending: dict[int, dict[str, Any]] = {}
        self._last_flush = time.monotonic()
        self._last_poll = 0.0
        self._stop: StopRequest | None = None

    # -- TrainingCallbacks ---------------------------------------------------------------------
    def on_train_begin(self, *, total_steps: int, n_epochs: int) -> None:
        self.total_steps, self.n_epochs = total_steps, n_epochs
        with session_scope() as session:
            session.execute(update(Job).where(Job.id == self.job_id).values(total_steps=total_steps))
            add_event(
                session,
                self.job_id,
                f"Training started: {total_steps} steps over {n_epochs} epoch(s)",
                data={"total_steps": total_steps, "n_epochs": n_epochs},
            )

    def on_step(self, row: dict[str, float]) -> None:
        # wall-clock time of the step, kept with the row: for plots against time and latency checks
        row = {**row, "logged_at": time.time()}
        self.last_row = row
        self._publish(row)
        self._buffer(int(row["step"]), row)
        if time.monotonic() - self._last_flush >= self.settings.metrics_flush_seconds:
            self.flush()

    def on_eval(self, row: dict[str, float]) -> None:
        self._publish(row)
        self._buffer(int(row["step"]), row)
        self.flush()

    def on_epoch_end(self, *, epoch: int, step: int) -> None:
        self.flush()
        with session_scope() as session:
            add_event(
                session,
                self.job_id,
                f"Epoch {epoch}/{self.n_epochs} completed at step {step}",
                data={"epoch": epoch, "step": step},
            )

    def on_checkpoint(self, ckpt: CheckpointInfo) -> None:
        self.flush()
        ckpt_id = new_id("ftckpt")
        prefix = f"checkpoints/{self.tenant_id}/{self.job_id}/{ckpt_id}"
        with tempfile.TemporaryDirectory() as tmp:
            size = tar_folder(ckpt.path / "model", Path(tmp) / "model.tar")
            self.blobs.put_file(f"{prefix}-model.tar", Path(tmp) / "model.tar")
            state_key = None
            if (ckpt.path / "state").is_dir():
                tar_folder(ckpt.path / "state", Path(tmp) / "state.tar")
                state_key = f"{prefix}-state.tar"
                self.blobs.put_file(state_key, Path(tmp) / "state.tar")
        name = self.fine_tuned_model if ckpt.final else f"{self.fine_tuned_model}:ckpt-step-{ckpt.step}"
        metrics = {"step": float(ckpt.step)}
        source = {**self.last_row, **ckpt.metrics}
        metrics.update({out: float(source[k]) for k, out in _CHECKPOINT_METRICS.items() if k in source})
        with session_scope() as session:
            session.add(
                Checkpoint(
                    id=ckpt_id,
                    job_id=self.job_id,
                    step=ckpt.step,
                    fine_tuned_model_checkpoint=name,
                    metrics=metrics,
                    blob_key=f"{prefix}-model.tar",
                    state_blob_key=state_key,
                    bytes=size,
                    is_final=ckpt.final,
                )
            )
            add_event(
                session,
                self.job_id,
                f"Checkpoint saved at step {ckpt.step}" + (" (final model)" if ckpt.final else ""),
                data={"checkpoint_id": ckpt_id, "step": ckpt.step},
            )
        if ckpt.final:
            self.final_checkpoint_id = ckpt_id

    def should_stop(self) -> StopRequest | None:
        if self._stop is not None:
            return self._stop
        if time.monotonic() - self._last_poll < self.settings.control_poll_seconds:
            return None
        self._last_poll = time.monotonic()
        with session_scope() as session:
            status, holder = session.execute(
                select(Job.status, Job.worker_id).where(Job.id == self.job_id)
            ).one()
        if status == "cancelled" or holder != self.worker_id:
            self._stop = StopRequest.CANCEL
        return self._stop

    # -- buffering -----------------------------------------------------------------------------
    def _buffer(self, step: int, row: dict[str, float]) -> None:
        values = {k: v for k, v in row.items() if k not in ("step", "epoch", "total_steps")}
        entry = self._pending.setdefault(step, {"epoch": float(row.get("epoch", 0.0)), "values": {}})
        entry["values"].update(values)

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        with session_scope() as session:
            for step, entry in sorted(pending.items()):
                row = session.get(JobMetric, (self.job_id, step))
                if row is None:
                    session.add(
                        JobMetric(job_id=self.job_id, step=step, epoch=entry["epoch"], values=entry["values"])
                    )
                else:
                    row.values = {**row.values, **entry["values"]}
                summary = ", ".join(
                    f"{k}={v:.4g}" for k, v in entry["values"].items() if k in ("loss", "valid_loss")
                )
                add_event(
                    session,
                    self.job_id,
                    f"Step {step}/{self.total_steps}: {summary}",
                    type="metrics",
                    data={"step": step, **entry["values"]},
                )
            last = max(pending)
            tokens = self.last_row.get("trained_tokens")
            session.execute(
                update(Job)
                .where(Job.id == self.job_id)
                .values(current_step=last, trained_tokens=int(tokens) if tokens is not None else None)
            )

    def _publish(self, row: dict[str, float]) -> None:
        """Live path: each row goes to Redis at once (the DB gets it at the next flush)."""
        if self.publisher is None:
            return
        # total_steps rides along so a live client can draw progress before it has read any event
        message = json.dumps({**row, "step": int(row["step"])})
        try:
            self.publisher.publish(channel(self.job_id), message)
        except Exception:  # a live stream is best effort; the DB row is the record
            log.warning("could not publish metrics for %s", self.job_id, exc_info=True)
