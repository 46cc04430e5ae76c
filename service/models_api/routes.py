"""/v1/models: the base models this deployment can fine-tune and the tenant's fine-tuned models (its
jobs' and its Tinker checkpoints, service/base_models/tinker_checkpoints.py), in OpenAI's shapes; DELETE
removes a job's fine-tuned model (service/models_api/lifecycle.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from service.auth import TenantDep
from service.base_models.catalog import BUILTIN_CREATED_AT, list_base_models, resolve_base_model
from service.base_models.fine_tuned import find_final_checkpoint, list_fine_tuned
from service.base_models.tinker_checkpoints import find_tinker_checkpoint, list_tinker_models
from service.dependencies import SessionDep, SettingsDep
from service.errors import Forbidden, NotFound, error_responses
from service.models_api.lifecycle import delete_fine_tuned_model, sweep_deleted_models
from service.storage import get_blob_store

router = APIRouter(prefix="/v1/models", tags=["models"], responses=error_responses(400, 401, 503))


def _model_object(entry_id: str, owned_by: str) -> dict[str, Any]:
    return {"id": entry_id, "object": "model", "created": BUILTIN_CREATED_AT, "owned_by": owned_by}


@router.get("")
def list_models(session: SessionDep, tenant: TenantDep, settings: SettingsDep) -> dict[str, Any]:
    """Base models, then the tenant's own fine-tuned models and Tinker checkpoints (which can be
    trained further)."""
    data = [_model_object(e.id, e.owned_by) for e in list_base_models(settings)]
    data += [
        {"id": name, "object": "model", "created": created, "owned_by": tenant.id}
        for name, created in list_fine_tuned(session, tenant_id=tenant.id)
        + list_tinker_models(session, tenant_id=tenant.id)
    ]
    return {"object": "list", "data": data}


@router.get("/{model_id:path}", responses=error_responses(404))
def retrieve_model(
    model_id: str, session: SessionDep, tenant: TenantDep, settings: SettingsDep
) -> dict[str, Any]:
    ckpt = find_final_checkpoint(session, tenant_id=tenant.id, name=model_id)
    if ckpt is not None:
        return {"id": model_id, "object": "model", "created": ckpt.created_at, "owned_by": tenant.id}
    tinker = find_tinker_checkpoint(session, tenant_id=tenant.id, name=model_id)
    if tinker is not None:
        return {"id": model_id, "object": "model", "created": tinker.created_at, "owned_by": tenant.id}
    entry = resolve_base_model(settings, model_id)
    if entry is None:
        raise NotFound(f"The model '{model_id}' does not exist", param="model", code="model_not_found")
    return _model_object(entry.id, entry.owned_by)


class ModelDeleted(BaseModel):
    id: str
    object: str = "model"
    deleted: bool = True


@router.delete("/{model_id:path}", response_model=ModelDeleted, responses=error_responses(403, 404))
def delete_model(
    model_id: str, session: SessionDep, tenant: TenantDep, settings: SettingsDep
) -> ModelDeleted:
    """Delete one of the organization's fine-tuned models; its job keeps its history."""
    if not model_id.startswith("ft:") and resolve_base_model(settings, model_id) is not None:
        raise Forbidden(
            f"'{model_id}' is a base model of this deployment; only fine-tuned models can be deleted",
            param="model",
            code="model_not_deletable",
        )
    ckpt = delete_fine_tuned_model(session, tenant_id=tenant.id, name=model_id)
    # the row first (committed), then the blobs, unless an unfinished job still needs them
    session.commit()
    sweep_deleted_models(
        session, blobs=get_blob_store(), models_dir=settings.models_dir, checkpoint_id=ckpt.id
    )
    return ModelDeleted(id=model_id)
