"""Deleting a fine-tuned model: DELETE /v1/models/{name}, in OpenAI's shape.

The model (its job's final checkpoint) is marked deleted at once, so it no longer lists, serves or
trains further (service/base_models/fine_tuned.py); the job keeps its history (status, events, metrics,
its other checkpoints). The final checkpoint's blobs are removed by `sweep_deleted_models` as soon as
nothing refers to them: a job that is not finished yet and fine-tunes from the model or grades with it
(a `score_model` grader) still needs them, as does another checkpoint row pointing at the same blob.
The API sweeps right after a deletion; each worker's reconciler sweeps on every pass (worker/reaper.py),
which removes what a running job held once that job ends.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from service.base_models.fine_tuned import find_final_checkpoint
from service.errors import NotFound
from service.graders.shapes import score_models
from service.ids import now
from service.jobs import repository
from service.jobs.spec import load_method
from service.models import Checkpoint, Job
from service.storage import BlobStore

log = logging.getLogger("tunehouse.models")


def delete_fine_tuned_model(session: Session, *, tenant_id: str, name: str) -> Checkpoint:
    """Mark the tenant's model `name` (a causal LM or a reward model) deleted; 404 if there is none."""
    ckpt = find_final_checkpoint(session, tenant_id=tenant_id, name=name) or find_final_checkpoint(
        session, tenant_id=tenant_id, name=name, reward_model=True
    )
    if ckpt is None:
        raise NotFound(f"The model '{name}' does not exist", param="model", code="model_not_found")
    ckpt.deleted_at = now()
    session.flush()
    return ckpt


def _still_needed(session: Session, ckpt: Checkpoint, tenant_id: str) -> bool:
    name = ckpt.fine_tuned_model_checkpoint
    for model, method in repository.unfinished_models_and_methods(session, tenant_id):
        if model == name:
            return True
        grader = load_method(method).grader
        if grader is not None and name in score_models(grader):
            return True
    shared = session.scalar(
        select(func.count())
        .select_from(Checkpoint)
        .where(
            Checkpoint.blob_key == ckpt.blob_key, Checkpoint.id != ckpt.id, Checkpoint.deleted_at.is_(None)
        )
    )
    return bool(shared)


def sweep_deleted_models(
    session: Session, *, blobs: BlobStore, models_dir: Path, checkpoint_id: str | None = None
) -> list[str]:
    """Remove the blobs of deleted models (all, or the one `checkpoint_id`) that nothing refers to any
    more; returns their checkpoint ids.

    Each row is cleared (blob_key "") and committed before its blobs go, so no reader is ever handed a
    key whose blob is missing; a crash in between leaves an orphan blob, never a dangling row."""
    stmt = (
        select(Checkpoint, Job.tenant_id)
        .join(Job, Job.id == Checkpoint.job_id)
        .where(Checkpoint.deleted_at.is_not(None), Checkpoint.blob_key != "")
    )
    if checkpoint_id is not None:
        stmt = stmt.where(Checkpoint.id == checkpoint_id)
    rows = session.execute(stmt).all()
    removed = []
    for ckpt, tenant_id in rows:
        if _still_needed(session, ckpt, tenant_id):
            continue
        keys = [k for k in (ckpt.blob_key, ckpt.state_blob_key) if k]
        session.execute(
            update(Checkpoint)
            .where(Checkpoint.id == ckpt.id)
            .values(blob_key="", state_blob_key=None, bytes=0)
            .execution_options(synchronize_session=False)
        )
        session.commit()
        for key in keys:
            blobs.delete(key)
        # the worker's unpacked copy (worker/models.py), when the API shares the workers' data dir
        shutil.rmtree(models_dir / "fine-tuned" / ckpt.id, ignore_errors=True)
        log.info("removed the blobs of deleted model %s (%s)", ckpt.fine_tuned_model_checkpoint, ckpt.id)
        removed.append(ckpt.id)
    return removed
