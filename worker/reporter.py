"""The trainer's callbacks for a job: metrics, events, checkpoints and cancel checks, into the DB.

Metric rows are buffered and flushed to the DB at least every `metrics_flush_seconds` (and at every
event that matters), so a fast loop does not pay a DB round trip per step; each row is also published
on Redis (`tunehouse:job:<id>`) as it is logged, when Redis is configured, for live streams (steps that
come faster than `LIVE_BATCH_SECONDS` go several to a message: service/jobs/live.py).
Both the publish and the timed flush run on the reporter's own thread (`_send_loop`): the training
thread only buffers a row and wakes it, so a step never waits on Redis or PostgreSQL round trips. The
writes that must land before the trainer goes on (an epoch's end, a checkpoint, the end of training)
flush from the training thread, which leaves publishing to the sender (only `close`, once training is
over, publishes what the sender left): a Redis that hangs holds up only the sender. So at such a
flush the DB may get a few rows before Redis carries them; a stream takes each step once, from
whichever path brings it first (service/jobs/stream.py), so nothing is lost or doubled.

A database outage does not stop training: rows stay in the buffer until a flush succeeds (none is
lost), cancel checks are skipped, and events and checkpoint records wait for the database (bounded by
`db_outage_tolerance_seconds`, see worker/outage.py). A Redis outage only pauses the live path.
"""

from __future__ import annotations

import logging
import tarfile
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import select

from service.config import Settings
from service.db import session_scope
from service.ids import new_id
from service.jobs import repository
from service.jobs.events import add_event, add_event_once
from service.jobs.live import LIVE_BATCH_SECONDS, PUBLISH_RETRY_SECONDS, channel, rows_message
from service.models import Checkpoint, JobMetric
from service.storage import BlobStore, BlobStoreUnavailable
from service.webhooks.events import CHECKPOINT_KIND
from trainers.core import turns
from trainers.core.loop import CheckpointInfo, StopRequest
from trainers.registry import OPENAI_CHECKPOINT_METRICS, OPENAI_CHECKPOINT_PREFIXES
from worker.checkpoints import prune_resumable_states
from worker.devices import StepSampler
from worker.outage import blob_outage_event, is_outage, retry_blob, retry_db
from worker.trackers import Tracker

log = logging.getLogger("tunehouse.worker")


def estimate_finish(*, now: float, origin: tuple[int, float], step: int, total: int) -> int | None:
    """When step `total` should be done (unix seconds): the mean wall time per step since `origin`
    (the step this process started from, and when), evaluations and checkpoints included, extrapolated
    over the steps left; None before the first step.

    >>> estimate_finish(now=130.0, origin=(10, 100.0), step=13, total=20)
    200
    >>> estimate_finish(now=100.0, origin=(10, 100.0), step=10, total=20) is None
    True
    """
    done = step - origin[0]
    if done <= 0:
        return None
    per_step = (now - origin[1]) / done
    return round(now + (total - step) * per_step)


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
        blobs: BlobStore,
        publisher: Any | None = None,
        shutdown: threading.Event | None = None,
        trackers: Sequence[Tracker] = (),
        at_train_begin: Callable[[], None] | None = None,
    ) -> None:
        self.job_id = job_id
        self.tenant_id = tenant_id
        self.worker_id = worker_id
        self.fine_tuned_model = fine_tuned_model
        self.settings = settings
        self.blobs = blobs
        self.publisher = publisher
        # set when the worker shuts down (SIGTERM): checkpoint at the next step and hand the job back
        self.shutdown = shutdown
        # the job's experiment trackers (worker/trackers.py): every step and eval row, as it comes
        self.trackers = trackers
        # the job process's work once the trainer's preparation is done and before its first step
        # (storing the reference log-probs its pass computed, so a worker that dies later keeps them)
        self.at_train_begin = at_train_begin
        self.total_steps: int | None = None
        self.n_epochs = 1
        self.last_row: dict[str, float] = {}
        self.final_checkpoint_id: str | None = None
        self._pending: dict[int, dict[str, Any]] = {}
        self._last_flush = time.monotonic()
        self._devices = StepSampler()  # each step row's device figures (worker/devices.py)
        # the sender thread (`_send_loop`): rows to publish, in step order, and what it must do next
        self._outbox: deque[dict[str, float]] = deque()
        self._buffer_lock = threading.Lock()  # _pending and _outbox, shared with the sender
        self._flush_lock = threading.Lock()  # one DB write of the buffer at a time
        self._publish_lock = threading.Lock()  # one drain of the outbox at a time: rows stay in order
        self._wake = threading.Event()
        self._flush_requested = False
        self._closed = False
        self._sender: threading.Thread | None = None
        self._sender_error: BaseException | None = None
        self._last_poll = 0.0
        self._stop: StopRequest | None = None
        self._publish_retry_at = 0.0
        self._published_at = 0.0  # monotonic time of the last publish (LIVE_BATCH_SECONDS apart)
        self._db_down_since: float | None = None
        # (step, unix time) this process started training from, for estimated_finish
        self._began_at = time.time()
        self._origin: tuple[int, float] | None = None

    def _must_write(self, what: str, fn: Callable[[], None]) -> None:
        """A write that must land (an event, a checkpoint record): waits out a database outage."""
        retry_db(fn, what=f"job {self.job_id}: {what}", tolerance=self.settings.db_outage_tolerance_seconds)

    def _upload(self, key: str, source: Path) -> None:
        """A checkpoint tar into the blob store, waiting out an outage (with an event saying so)."""
        tolerance = self.settings.blob_outage_tolerance_seconds
        retry_blob(
            lambda: self.blobs.put_file(key, source),
            what=f"job {self.job_id}: checkpoint upload",
            tolerance=tolerance,
            on_first_retry=lambda exc: blob_outage_event(self.job_id, exc, tolerance),
        )

    # -- TrainingCallbacks ---------------------------------------------------------------------
    def on_train_begin(self, *, total_steps: int, n_epochs: int) -> None:
        self.total_steps, self.n_epochs = total_steps, n_epochs
        self._began_at = time.time()  # model loading and a resume's restore are not step time

        def write() -> None:
            with session_scope() as session:
                repository.set_total_steps(session, self.job_id, total_steps)
                add_event(
                    session,
                    self.job_id,
                    f"Training started: {total_steps} steps over {n_epochs} epoch(s)",
                    data={"total_steps": total_steps, "n_epochs": n_epochs},
                )

        self._must_write("training started", write)
        if self.at_train_begin is not None:
            with turns.away():  # an upload
                self.at_train_begin()

    def on_step(self, row: dict[str, float]) -> None:
        self._raise_sender_error()
        # wall-clock time of the step, kept with the row: for plots against time and latency checks; and
        # what the job's devices were doing (GPU utilisation and memory, the trainer's RSS), charted
        row = {**row, "logged_at": time.time(), **self._devices()}
        self.last_row = row
        if self._origin is None:  # a resumed run's first step is not step 1
            self._origin = (int(row["step"]) - 1, self._began_at)
        self._track(row)
        self._hand_over(row, flush_now=False)

    def on_eval(self, row: dict[str, float]) -> None:
        self._raise_sender_error()
        self._track(row)
        self._hand_over(row, flush_now=True)  # an evaluation is written at once, by the sender

    def on_epoch_end(self, *, epoch: int, step: int) -> None:
        self._raise_sender_error()
        self.flush(wait=True)

        def write() -> None:
            with session_scope() as session:
                # once per epoch: a run resumed from a checkpoint before this epoch's end passes it again
                add_event_once(
                    session,
                    self.job_id,
                    f"epoch-{epoch}",
                    f"Epoch {epoch}/{self.n_epochs} completed at step {step}",
                    data={"epoch": epoch, "step": step},
                )

        self._must_write("epoch event", write)

    def on_checkpoint(self, ckpt: CheckpointInfo) -> None:
        # the files are written: jobs beside this one on a shared base train while they upload
        with turns.away():
            self._store_checkpoint(ckpt)

    def _store_checkpoint(self, ckpt: CheckpointInfo) -> None:
        # the rows up to this step land first: a resume from this checkpoint must find no gap
        self.flush(wait=True)
        ckpt_id = new_id("ftckpt")
        prefix = f"checkpoints/{self.tenant_id}/{self.job_id}/{ckpt_id}"
        # tarred on the worker's local disk, then streamed to the blob store from there (multipart on S3)
        with tempfile.TemporaryDirectory() as tmp:
            size = tar_folder(ckpt.path / "model", Path(tmp) / "model.tar")
            self._upload(f"{prefix}-model.tar", Path(tmp) / "model.tar")
            state_key = None
            if (ckpt.path / "state").is_dir():
                tar_folder(ckpt.path / "state", Path(tmp) / "state.tar")
                state_key = f"{prefix}-state.tar"
                self._upload(state_key, Path(tmp) / "state.tar")
        name = self.fine_tuned_model if ckpt.final else f"{self.fine_tuned_model}:ckpt-step-{ckpt.step}"
        metrics = {"step": float(ckpt.step)}
        source = {**self.last_row, **ckpt.metrics}
        metrics.update({out: float(source[k]) for k, out in OPENAI_CHECKPOINT_METRICS.items() if k in source})
        metrics.update({k: float(v) for k, v in source.items() if k.startswith(OPENAI_CHECKPOINT_PREFIXES)})

        def write() -> None:
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
                    data={"kind": CHECKPOINT_KIND, "checkpoint_id": ckpt_id, "step": ckpt.step},
                )

        self._must_write("checkpoint record", write)
        if ckpt.final:
            self.final_checkpoint_id = ckpt_id
        else:
            try:
                prune_resumable_states(self.blobs, self.job_id, keep=self.settings.checkpoint_keep)
            except Exception as exc:  # housekeeping: the next checkpoint prunes what this one could not
                if not (is_outage(exc) or isinstance(exc, BlobStoreUnavailable)):
                    raise

    def should_stop(self) -> StopRequest | None:
        if self._stop is not None:
            return self._stop
        if self.shutdown is not None and self.shutdown.is_set():
            self._stop = StopRequest.PAUSE  # the job process hands the job back after the checkpoint
            return self._stop
        if time.monotonic() - self._last_poll < self.settings.control_poll_seconds:
            return None
        self._last_poll = time.monotonic()
        try:
            with session_scope() as session:
                status, holder, pause = repository.control_state(session, self.job_id)
        except Exception as exc:
            if not is_outage(exc):
                raise
            return None  # nobody can cancel through a database that is down; ask again next poll
        if status == "cancelled" or holder != self.worker_id:
            self._stop = StopRequest.CANCEL
        elif pause:
            self._stop = StopRequest.PAUSE
        return self._stop

    def on_message(self, message: str) -> None:
        def write() -> None:
            with session_scope() as session:
                add_event(session, self.job_id, message)

        self._must_write("trainer message", write)

    # -- the sender thread ---------------------------------------------------------------------
    def _hand_over(self, row: dict[str, float], *, flush_now: bool) -> None:
        """Buffer a row for the DB and queue it for the live path; the sender does the I/O."""
        values = {k: v for k, v in row.items() if k not in ("step", "epoch", "total_steps")}
        with self._buffer_lock:
            entry = self._pending.setdefault(
                int(row["step"]), {"epoch": float(row.get("epoch", 0.0)), "values": {}}
            )
            entry["values"].update(values)
            if self.publisher is not None:
                self._outbox.append(row)
            self._flush_requested = self._flush_requested or flush_now
        if self._sender is None:
            self._sender = threading.Thread(
                target=self._send_loop, name=f"reporter-{self.job_id}", daemon=True
            )
            self._sender.start()
        if self.publisher is not None or flush_now:
            self._wake.set()  # otherwise the sender wakes when the next timed flush is due

    def _send_loop(self) -> None:
        try:
            while not self._closed:
                due = self._last_flush + self.settings.metrics_flush_seconds
                self._wake.wait(timeout=max(0.0, due - time.monotonic()))
                self._wake.clear()
                # steps faster than LIVE_BATCH_SECONDS: their rows wait and go out in one message
                if (rest := self._published_at + LIVE_BATCH_SECONDS - time.monotonic()) > 0:
                    time.sleep(rest)
                self._drain_outbox()
                with self._buffer_lock:
                    requested, self._flush_requested = self._flush_requested, False
                if requested or time.monotonic() >= self._last_flush + self.settings.metrics_flush_seconds:
                    self.flush()
        except BaseException as exc:  # the training thread raises it at its next call (an outage too long)
            log.warning("job %s: the reporter's sender stopped: %r", self.job_id, exc)
            self._sender_error = exc

    def _raise_sender_error(self) -> None:
        if self._sender_error is not None:
            raise self._sender_error

    def close(self) -> None:
        """Stop the sender and publish what it had queued. The buffer stays for the caller's
        `flush(wait=True)`, which waits out an outage the sender may have stopped on."""
        self._closed = True
        self._wake.set()
        if self._sender is not None:
            self._sender.join()
        self._drain_outbox()

    def _drain_outbox(self) -> None:
        with self._publish_lock:
            with self._buffer_lock:
                rows = list(self._outbox)
                self._outbox.clear()
            if rows:
                self._publish(rows)

    # -- buffering -----------------------------------------------------------------------------
    def flush(self, *, wait: bool = False) -> None:
        """Write the buffered rows. During a database outage they stay buffered (merged with newer
        rows) and the next flush tries again; `wait=True` blocks until they are written. The live path
        is left to the sender, which publishes what it has queued before its own flushes: a training
        thread that drained it here would wait out every publish to a hung Redis (a whole timeout at
        each epoch's end)."""
        with self._flush_lock:
            self._flush_buffer(wait=wait)

    def _flush_buffer(self, *, wait: bool) -> None:
        self._last_flush = time.monotonic()
        self._devices = StepSampler()  # each step row's device figures (worker/devices.py)
        if not self._pending:
            return
        if wait:
            self._must_write("metrics", self._write_pending)
            return
        try:
            self._write_pending()
        except Exception as exc:
            if not is_outage(exc):
                raise
            if self._db_down_since is None:
                self._db_down_since = time.monotonic()
                log.warning("job %s: database unavailable; buffering metrics", self.job_id)
            elif time.monotonic() - self._db_down_since > self.settings.db_outage_tolerance_seconds:
                raise
            return
        if self._db_down_since is not None:
            log.warning(
                "job %s: database back after %.1fs; buffered metrics written",
                self.job_id,
                time.monotonic() - self._db_down_since,
            )
            self._db_down_since = None

    def _write_pending(self) -> None:
        # the rows are taken out of the buffer, and put back (under any newer values of their steps)
        # if the write fails: a failed write keeps every row for the next try
        with self._buffer_lock:
            pending, self._pending = self._pending, {}
        try:
            self._write_rows(pending)
        except BaseException:
            with self._buffer_lock:
                for step, entry in self._pending.items():
                    if step in pending:
                        pending[step]["values"].update(entry["values"])
                    else:
                        pending[step] = entry
                self._pending = pending
            raise

    def _write_rows(self, pending: dict[int, dict[str, Any]]) -> None:
        with session_scope() as session:
            # the rows these steps already have (a resumed run re-logs, an evaluation joins its step):
            # one query for the whole buffer, not one per step
            stored = session.scalars(
                select(JobMetric).where(JobMetric.job_id == self.job_id, JobMetric.step.in_(list(pending)))
            )
            existing = {row.step: row for row in stored}
            for step, entry in sorted(pending.items()):
                row = existing.get(step)
                if row is None:
                    session.add(
                        JobMetric(job_id=self.job_id, step=step, epoch=entry["epoch"], values=entry["values"])
                    )
                else:
                    # a step re-run after a resume (the same values) or an evaluation joining its step
                    known = set(row.values)
                    row.values = {**row.values, **entry["values"]}
                    if known.issuperset(entry["values"]):
                        continue  # its "Step N" event exists already: no duplicate after a restart
                summary = ", ".join(
                    f"{k}={v:.4g}"
                    for k, v in entry["values"].items()
                    if k in ("loss", "valid_loss", "valid_reward")
                )
                add_event(
                    session,
                    self.job_id,
                    f"Step {step}/{self.total_steps}: {summary}",
                    type="metrics",
                    data={"step": step, **entry["values"]},
                )
            last = max(pending)
            # the tokens of the last step written (not of a newer step the trainer logged meanwhile)
            tokens = next(
                (
                    e["values"]["trained_tokens"]
                    for _, e in sorted(pending.items(), reverse=True)
                    if "trained_tokens" in e["values"]
                ),
                None,
            )
            finish = None
            if self._origin is not None and self.total_steps is not None:
                finish = estimate_finish(
                    now=time.time(), origin=self._origin, step=last, total=self.total_steps
                )
            progress: dict[str, Any] = {"current_step": last, "estimated_finish": finish}
            if tokens is not None:  # an evaluation row alone does not know the step's tokens
                progress["trained_tokens"] = int(tokens)
            repository.record_progress(session, self.job_id, **progress)

    def _track(self, row: dict[str, float]) -> None:
        for tracker in self.trackers:
            tracker.log(row)

    def _publish(self, rows: list[dict[str, float]]) -> None:
        """Live path: the rows go to Redis in one message (the DB gets them at the next flush)."""
        if self.publisher is None or time.monotonic() < self._publish_retry_at:
            return
        self._published_at = time.monotonic()
        try:
            self.publisher.publish(channel(self.job_id), rows_message(rows))
        except Exception as exc:  # a live stream is best effort; the DB row is the record
            self._publish_retry_at = time.monotonic() + PUBLISH_RETRY_SECONDS
            log.warning("could not publish metrics for %s: %s", self.job_id, exc)
