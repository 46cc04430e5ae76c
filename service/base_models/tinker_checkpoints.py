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

from sqlalchemy import ColumnElement, and_, delete, func, select, update
from sqlalchemy.orm import Session

from service.ids import new_id, now
from service.models import TinkerCheckpoint

TINKER_PATH_PREFIX = "tinker://"


def tinker_blob_key(tenant_id: str, model_id: str, kind: str, name: str) -> str:
    """The blob of a saved state or sampler weights as the Tinker host reads them back (a torch file)."""
    return f"tinker/{tenant_id}/{model_id}/{kind}/{name}.pt"


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


def _listed(tenant_id: str) -> ColumnElement[bool]:
    """The tenant's checkpoints that still list: not past their expiry (the reaper deletes those)."""
    expiry = TinkerCheckpoint.expires_at
    return and_(TinkerCheckpoint.tenant_id == tenant_id, expiry.is_(None) | (expiry > now()))


def run_checkpoints(session: Session, *, tenant_id: str, run_id: str) -> list[TinkerCheckpoint]:
    """A run's checkpoints, oldest first (`RestClient.list_checkpoints`)."""
    stmt = (
        select(TinkerCheckpoint)
        .where(_listed(tenant_id), TinkerCheckpoint.training_run_id == run_id)
        .order_by(TinkerCheckpoint.created_at, TinkerCheckpoint.id)
    )
    return list(session.execute(stmt).scalars())


def tenant_checkpoints(
    session: Session, *, tenant_id: str, limit: int, offset: int
) -> tuple[list[TinkerCheckpoint], int]:
    """A page of the tenant's checkpoints across runs, newest first, and how many there are."""
    where = _listed(tenant_id)
    order = (TinkerCheckpoint.created_at.desc(), TinkerCheckpoint.id.desc())
    stmt = select(TinkerCheckpoint).where(where).order_by(*order)
    rows = list(session.execute(stmt.offset(offset).limit(limit)).scalars())
    total = session.execute(select(func.count()).select_from(TinkerCheckpoint).where(where)).scalar_one()
    return rows, int(total)


def set_tinker_checkpoint_ttl(session: Session, *, row: TinkerCheckpoint, ttl_seconds: int | None) -> None:
    expires = None if ttl_seconds is None else now() + ttl_seconds
    session.execute(update(TinkerCheckpoint).where(TinkerCheckpoint.id == row.id).values(expires_at=expires))


def forget_tinker_checkpoint(session: Session, *, row: TinkerCheckpoint) -> list[str]:
    """Delete the row; the blob keys the caller removes once it commits (the model's tar, the state)."""
    session.execute(delete(TinkerCheckpoint).where(TinkerCheckpoint.id == row.id))
    run_id, kind = row.training_run_id, row.kind
    return [row.blob_key, tinker_blob_key(row.tenant_id, run_id, kind, row.name)]


def expired_tinker_checkpoints(session: Session, *, limit: int = 100) -> list[TinkerCheckpoint]:
    stmt = select(TinkerCheckpoint).where(TinkerCheckpoint.expires_at <= now()).limit(limit)
    return list(session.execute(stmt).scalars())


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
    ttl_seconds: int | None = None,
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
        expires_at=None if ttl_seconds is None else now() + ttl_seconds,
    )
    session.add(row)
    return row
