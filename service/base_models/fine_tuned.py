"""Fine-tuned models as inputs to later jobs: a job's final checkpoint, by its `ft:...` name, scoped to
the tenant. Causal LMs can be trained further (`model`); reward models feed graders and PPO.

`find_final_checkpoint` is the one place a `ft:` name becomes a model: everything that lists, serves or
trains from a fine-tuned model asks it, so a deleted model (DELETE /v1/models/{name}) is gone for all of
them at once. Only a job created before the deletion still gets it (`include_deleted`), because its
blobs are kept until that job ends (service/models_api/lifecycle.py)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import Checkpoint, Job


def find_final_checkpoint(
    session: Session,
    *,
    tenant_id: str,
    name: str,
    reward_model: bool = False,
    include_deleted: bool = False,
) -> Checkpoint | None:
    stmt = (
        select(Checkpoint, Job.method)
        .join(Job, Job.id == Checkpoint.job_id)
        .where(
            Job.tenant_id == tenant_id, Checkpoint.fine_tuned_model_checkpoint == name, Checkpoint.is_final
        )
    )
    if not include_deleted:
        stmt = stmt.where(Checkpoint.deleted_at.is_(None))
    for ckpt, method in session.execute(stmt).all():
        if (method.get("type") == "reward_model") == reward_model:
            found: Checkpoint = ckpt
            return found
    return None


def list_fine_tuned(session: Session, *, tenant_id: str) -> list[tuple[str, int]]:
    """(name, created_at) of the tenant's trainable fine-tuned models that are not deleted, newest first."""
    stmt = (
        select(Job.fine_tuned_model, Job.finished_at, Job.method)
        .join(Checkpoint, (Checkpoint.job_id == Job.id) & Checkpoint.is_final)
        .where(
            Job.tenant_id == tenant_id,
            Job.status == "succeeded",
            Job.fine_tuned_model.is_not(None),
            Checkpoint.fine_tuned_model_checkpoint == Job.fine_tuned_model,
            Checkpoint.deleted_at.is_(None),
        )
        .order_by(Job.id.desc())
    )
    return [
        (str(name), int(finished or 0))
        for name, finished, method in session.execute(stmt).all()
        if method.get("type") != "reward_model"
    ]
