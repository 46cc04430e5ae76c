"""Which weights a model name stands for, for the tenant asking: the one place a `model` given to
inference is resolved (service/inference), so every rule about what may serve (tenant scoping,
reward models, deleted models) lives here.

- a base model of `/v1/models` (the bundled tiny model, the operator's registry, hub ids when allowed);
- the tenant's fine-tuned model `ft:...` (its final checkpoint) or one of its checkpoints by OpenAI's
  name (`ft:...:ckpt-step-N`) or by id (`ftckpt-...`). A checkpoint's `base` is the model its job
  trained from: an intermediate LoRA checkpoint holds only the adapter, served on top of that base;
- the tenant's Tinker checkpoint (`tinker://...`, `ft:...:tinker:...`, `ftckpt-...`,
  service/base_models/tinker_checkpoints.py): an adapter on its run's base model.
"""

from __future__ import annotations

from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.base_models.catalog import BUILTIN_CREATED_AT, resolve_base_model
from service.base_models.tinker_checkpoints import TINKER_PATH_PREFIX, find_tinker_checkpoint
from service.config import Settings
from service.models import Checkpoint, Job

CHECKPOINT_ID_PREFIX = "ftckpt-"


class ModelWeights(BaseModel):
    """What an inference worker loads; JSON-safe, it travels in the task message."""

    model: str  # the name the client gave, echoed in responses
    tenant_id: str
    base: str  # a base model name, or (for a checkpoint) the `model` its job trained from
    checkpoint_id: str | None = None
    blob_key: str | None = None  # the checkpoint's model tar
    reward_model: bool = False  # a reward model scores text; it cannot generate
    created: int
    owned_by: str


def find_model_weights(
    session: Session, settings: Settings, *, tenant_id: str, name: str
) -> ModelWeights | None:
    """The weights `name` stands for in this tenant, or None (the caller answers 404)."""
    if name.startswith(("ft:", CHECKPOINT_ID_PREFIX)) and (
        found := find_job_checkpoint(session, tenant_id=tenant_id, name=name)
    ):
        ckpt, job = found
        return ModelWeights(
            model=name,
            tenant_id=tenant_id,
            base=job.model,
            checkpoint_id=ckpt.id,
            blob_key=ckpt.blob_key,
            reward_model=job.method.get("type") == "reward_model",
            created=ckpt.created_at,
            owned_by=tenant_id,
        )
    if name.startswith(("ft:", CHECKPOINT_ID_PREFIX, TINKER_PATH_PREFIX)):
        tinker = find_tinker_checkpoint(session, tenant_id=tenant_id, name=name)
        if tinker is None:
            return None
        return ModelWeights(
            model=name,
            tenant_id=tenant_id,
            base=tinker.base_model,
            checkpoint_id=tinker.id,
            blob_key=tinker.blob_key,
            created=tinker.created_at,
            owned_by=tenant_id,
        )
    entry = resolve_base_model(settings, name, session)
    if entry is None:
        return None
    return ModelWeights(
        model=name, tenant_id=tenant_id, base=entry.id, created=BUILTIN_CREATED_AT, owned_by=entry.owned_by
    )


def find_job_checkpoint(session: Session, *, tenant_id: str, name: str) -> tuple[Checkpoint, Job] | None:
    """A job's checkpoint of this tenant by OpenAI's name (`ft:...`, `ft:...:ckpt-step-N`) or id
    (`ftckpt-...`), not deleted; the final one first when a name is both."""
    stmt = (
        select(Checkpoint, Job)
        .join(Job, Job.id == Checkpoint.job_id)
        .where(Job.tenant_id == tenant_id, Checkpoint.deleted_at.is_(None))  # DELETE /v1/models
    )
    if name.startswith(CHECKPOINT_ID_PREFIX):
        stmt = stmt.where(Checkpoint.id == name)
    else:
        # the final checkpoint carries the model's own name; intermediate ones `...:ckpt-step-N`
        stmt = stmt.where(Checkpoint.fine_tuned_model_checkpoint == name)
    found = session.execute(stmt.order_by(Checkpoint.is_final.desc()).limit(1)).tuples().first()
    return None if found is None else (found[0], found[1])
