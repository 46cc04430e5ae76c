"""Tinker checkpoints as tunehouse models. A checkpoint saved with `save_state` or a named
`save_weights_for_sampler` is a row here (written by the Tinker host once its files are stored) and then a
model of its tenant like a job's checkpoint, under three names:

- `tinker://<run>/<kind>/<name>`: the path the SDK answered;
- `ft:<base>:<tenant>:tinker:<run>/<kind>/<name>`: the same path after `tinker:`, with the base model in
  front as in every `ft:` name (a run on a fine-tuned model is named after that model's own base);
- `ftckpt-...`: its id.

Each serves as its run's base model with the LoRA adapter on top (the row's tar is a peft adapter folder).
Saving again under the same name replaces the row, with a new id, so caches keyed by id never serve the
old weights.
"""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.ids import new_id
from service.models import TinkerCheckpoint

TINKER_PATH_PREFIX = "tinker://"


def tinker_path(model_id: str, kind: str, name: str) -> str:
    """`tinker://<run>/weights/<name>` (a saved state) or `.../sampler_weights/<name>` (sampler weights)."""
    return f"{TINKER_PATH_PREFIX}{model_id}/{kind}/{name}"


def tinker_model_name(*, base_model: str, tenant_id: str, tinker_path: str) -> str:
    base = base_model.split(":")[1] if base_model.startswith("ft:") else base_model
    return f"ft:{base}:{tenant_id}:tinker:{tinker_path.removeprefix(TINKER_PATH_PREFIX)}"


def find_tinker_checkpoint(session: Session, *, tenant_id: str, name: str) -> TinkerCheckpoint | None:
    """The tenant's Tinker checkpoint that `name` (any of its three names) stands for, or None."""
    if name.startswith(TINKER_PATH_PREFIX):
        column = TinkerCheckpoint.tinker_path
    elif name.startswith("ftckpt-"):
        column = TinkerCheckpoint.id
    elif name.startswith("ft:") and ":tinker:" in name:
        column = TinkerCheckpoint.fine_tuned_model
    else:
        return None
    stmt = select(TinkerCheckpoint).where(TinkerCheckpoint.tenant_id == tenant_id, column == name)
    return session.execute(stmt.limit(1)).scalars().first()


def list_tinker_models(session: Session, *, tenant_id: str) -> list[tuple[str, int]]:
    """(ft: name, created_at) of the tenant's Tinker checkpoints, newest first."""
    stmt = (
        select(TinkerCheckpoint.fine_tuned_model, TinkerCheckpoint.created_at)
        .where(TinkerCheckpoint.tenant_id == tenant_id)
        .order_by(TinkerCheckpoint.created_at.desc(), TinkerCheckpoint.id.desc())
    )
    return [(str(name), int(created)) for name, created in session.execute(stmt).all()]


def record_tinker_checkpoint(
    session: Session,
    *,
    tenant_id: str,
    training_run_id: str,
    kind: str,
    name: str,
    base_model: str,
    blob_key: str,
    size: int,
    checkpoint_id: str | None = None,
) -> TinkerCheckpoint:
    """Insert the checkpoint, replacing one of the same path (the caller commits)."""
    path = tinker_path(training_run_id, kind, name)
    session.execute(
        delete(TinkerCheckpoint).where(
            TinkerCheckpoint.tenant_id == tenant_id, TinkerCheckpoint.tinker_path == path
        )
    )
    row = TinkerCheckpoint(
        id=checkpoint_id or new_id("ftckpt"),
        tenant_id=tenant_id,
        training_run_id=training_run_id,
        kind=kind,
        name=name,
        tinker_path=path,
        fine_tuned_model=tinker_model_name(base_model=base_model, tenant_id=tenant_id, tinker_path=path),
        base_model=base_model,
        blob_key=blob_key,
        bytes=size,
    )
    session.add(row)
    return row
