"""What a `load_weights` path stands for (`load_state`, `create_training_client_from_state`): a Tinker
saved state by any of its names (service/base_models/tinker_checkpoints.py; from PostgreSQL and the
blobs even when its run's Redis entry is gone), or a job's checkpoint of the tenant (`ftckpt-...`,
`ft:...`, `ft:...:ckpt-step-N`). A refusal is a 4xx naming `path` or `optimizer`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.base_models.tinker_checkpoints import TINKER_PATH_PREFIX, find_tinker_checkpoint
from service.base_models.weights import find_job_checkpoint
from service.errors import BadRequest, NotFound
from service.tinker.service import Tinker, TinkerPath, guard

DEFAULT_RANK = 32  # the SDK's create_lora_training_client default: a client made from a job's final model


@dataclass(frozen=True)
class Source:
    """What a load_weights call loads: a Tinker saved state, or a job's checkpoint."""

    base_model: str
    # the state's LoRA shape; None: only the state itself says (a job's adapter, a run Redis lost)
    spec: dict[str, Any] | None
    args: dict[str, Any]  # for the host's op_load_weights


def _job_source(session: Session, tenant_id: str, path: str, *, optimizer: bool, create: bool) -> Source:
    """A job's checkpoint (`ftckpt-...`, `ft:...`, `ft:...:ckpt-step-N`) to load: an intermediate LoRA
    checkpoint's adapter (weights; the optimizer starts fresh), or, for a new client, a final model as the
    client's base with a fresh adapter (the client then computes exactly what the job's model does)."""
    found = find_job_checkpoint(session, tenant_id=tenant_id, name=path)
    session.commit()
    if found is None:
        raise NotFound(f"path: no checkpoint '{path}' in this organization", param="path", code="not_found")
    ckpt, job = found
    if optimizer:
        raise BadRequest(
            "optimizer: a job's checkpoint loads its weights only (load_state, "
            "create_training_client_from_state); its optimizer state is not in a form a client holds",
            param="optimizer",
        )
    if job.method.get("type") == "reward_model":
        raise BadRequest(f"path: '{path}' is a reward model, not a language model", param="path")
    hyperparameters = job.method.get(job.method["type"], {}).get("hyperparameters", {})
    if not ckpt.is_final and hyperparameters.get("lora", True):
        return Source(
            job.model, None, {"job_checkpoint": {"checkpoint_id": ckpt.id, "blob_key": ckpt.blob_key}}
        )
    if create and ckpt.is_final:
        return Source(ckpt.fine_tuned_model_checkpoint, {"rank": DEFAULT_RANK}, {"blank": True})
    raise BadRequest(
        f"path: '{path}' holds full weights, not a LoRA adapter; start a training client on it "
        f"(create_lora_training_client(base_model=...) with its ft: model)",
        param="path",
    )


async def load_source(
    tinker: Tinker, session: Session, tenant_id: str, path: str, *, optimizer: bool, create: bool
) -> Source:
    row = await run_in_threadpool(_tinker_checkpoint, session, tenant_id, path)
    if row is None and not path.startswith(TINKER_PATH_PREFIX):
        return await run_in_threadpool(
            _job_source, session, tenant_id, path, optimizer=optimizer, create=create
        )
    if row is not None:
        path = row[0]  # the Tinker checkpoint's own path, whichever of its names was given
    parsed = TinkerPath.parse(path, param="path")
    if parsed.kind != "weights":
        raise BadRequest(
            "path: load a saved state (tinker://<run>/weights/<name>), not sampler weights", param="path"
        )
    args = {"path": path, "source": parsed.model_id, "name": parsed.name}
    try:
        source = await guard(tinker.model(tenant_id, parsed.model_id, param="path"))
    except NotFound:
        if row is None:
            raise
        # the run's Redis entry is gone, its checkpoint is not (PostgreSQL, the blob store): the state
        # carries its own LoRA shape, which the host gives the new client
        return Source(row[1], None, args)
    return Source(source["base_model"], json.loads(source["spec"]), args)


def _tinker_checkpoint(session: Session, tenant_id: str, name: str) -> tuple[str, str] | None:
    """(its Tinker path, its run's base model) of the tenant's Tinker checkpoint `name`, or None."""
    found = find_tinker_checkpoint(session, tenant_id=tenant_id, name=name)
    session.commit()
    return None if found is None else (found.tinker_path, found.base_model)
