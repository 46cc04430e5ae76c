"""Fine-tuned models as inputs to later jobs: a job's final checkpoint, by its `ft:...` name, scoped to
the tenant. Causal LMs can be trained further (`model`); reward models feed graders and PPO."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import Checkpoint, Job


def find_final_checkpoint(
    session: Session, *, tenant_id: str, name: str, reward_model: bool = False
) -> Checkpoint | None:
    stmt = (
        select(Checkpoint, Job.method)
        .join(Job, Job.id == Checkpoint.job_id)
        .where(
            Job.tenant_id == tenant_id, Checkpoint.fine_tuned_model_checkpoint == name, Checkpoint.is_final
        )
    )
    for ckpt, method in session.execute(stmt).tuples():
        if (method.get("type") == "reward_model") == reward_model:
            found: Checkpoint = ckpt
            return found
    return None


def list_fine_tuned(session: Session, *, tenant_id: str) -> list[tuple[str, int]]:
    """(name, created_at) of the tenant's trainable fine-tuned models, newest first."""
    stmt = (
        select(Job.fine_tuned_model, Job.finished_at, Job.method)
        .where(Job.tenant_id == tenant_id, Job.status == "succeeded", Job.fine_tuned_model.is_not(None))
        .order_by(Job.id.desc())
    )
    return [
        (str(name), int(finished or 0))
        for name, finished, method in session.execute(stmt).tuples()
        if method.get("type") != "reward_model"
    ]
