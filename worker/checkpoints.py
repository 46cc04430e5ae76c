"""A job's resumable states in the blob store: restore the newest one that verifies, prune old ones.

Each checkpoint row points at two tars, the model and the training state. A resumed run unpacks the
newest pair and checks it against the manifest the trainer wrote (trainers.core.checkpoint.verify_checkpoint);
a pair that is missing, truncated or incomplete is skipped for the one before it, with an event, so a
damaged checkpoint costs one interval of training, not the job.
"""

from __future__ import annotations

import logging
import shutil
import tarfile
from pathlib import Path

from sqlalchemy import select, update

from service.db import session_scope
from service.jobs.events import add_event
from service.models import Checkpoint
from service.storage import BlobStore, BlobStoreUnavailable
from trainers.core.checkpoint import MODEL_DIR, STATE_DIR, verify_checkpoint

log = logging.getLogger("tunehouse.worker")


def _unpack(blobs: BlobStore, key: str, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with blobs.open(key) as fh, tarfile.open(fileobj=fh, mode="r|") as tar:
        tar.extractall(dest, filter="data")


def restore_latest_checkpoint(blobs: BlobStore, job_id: str, workdir: Path) -> tuple[Path | None, int]:
    """Unpack the job's newest verifiable resumable checkpoint under `workdir`; (None, 0) if none."""
    with session_scope() as session:
        rows = session.execute(
            select(Checkpoint.step, Checkpoint.blob_key, Checkpoint.state_blob_key)
            .where(Checkpoint.job_id == job_id, Checkpoint.state_blob_key.is_not(None))
            .order_by(Checkpoint.step.desc())
        ).all()
    for step, model_key, state_key in rows:
        assert state_key is not None  # selected so
        folder = workdir / f"resume-{step}"
        try:
            _unpack(blobs, model_key, folder / MODEL_DIR)
            _unpack(blobs, state_key, folder / STATE_DIR)
            verify_checkpoint(folder)
        except BlobStoreUnavailable:
            # not damage: the caller retries the restore once the store answers again
            shutil.rmtree(folder, ignore_errors=True)
            raise
        except (OSError, tarfile.TarError, ValueError) as exc:
            log.warning("job %s: checkpoint at step %s is unusable: %s", job_id, step, exc)
            shutil.rmtree(folder, ignore_errors=True)
            with session_scope() as session:
                add_event(
                    session,
                    job_id,
                    f"The checkpoint at step {step} is damaged ({exc}); trying the one before it",
                    level="warn",
                    data={"step": step},
                )
            continue
        return folder, step
    return None, 0


def prune_resumable_states(blobs: BlobStore, job_id: str, *, keep: int) -> None:
    """Keep the training state of the newest `keep` checkpoints only; older ones stay downloadable
    (their model tar is kept) but can no longer be resumed from."""
    with session_scope() as session:
        old = session.execute(
            select(Checkpoint.id, Checkpoint.state_blob_key)
            .where(Checkpoint.job_id == job_id, Checkpoint.state_blob_key.is_not(None))
            .order_by(Checkpoint.step.desc())
            .offset(keep)
        ).all()
        for ckpt_id, _ in old:
            session.execute(update(Checkpoint).where(Checkpoint.id == ckpt_id).values(state_blob_key=None))
    # blobs go after the rows stop pointing at them, so a resume never picks a deleted state
    for _, key in old:
        if key is not None:
            blobs.delete(key)
