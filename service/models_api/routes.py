"""/v1/models: the base models this deployment can fine-tune and the tenant's fine-tuned models (its
jobs' and its Tinker checkpoints, service/base_models/tinker_checkpoints.py), in OpenAI's shapes; DELETE
removes a job's fine-tuned model (service/models_api/lifecycle.py)."""

from __future__ import annotations

from fastapi import APIRouter

from service.auth import TenantDep
from service.base_models.catalog import (
    BaseModelEntry,
    list_base_models,
    resolve_base_model,
    unknown_model_message,
)
from service.base_models.fine_tuned import find_final_checkpoint, list_fine_tuned
from service.base_models.tinker_checkpoints import find_tinker_checkpoint, list_tinker_models
from service.dependencies import SessionDep, SettingsDep
from service.errors import Forbidden, NotFound, error_responses
from service.models_api.lifecycle import delete_fine_tuned_model, sweep_deleted_models
from service.models_api.schemas import ModelDeleted, ModelList, ModelObject
from service.storage import get_blob_store

router = APIRouter(prefix="/v1/models", tags=["models"], responses=error_responses(400, 401, 503))


def _base_object(entry: BaseModelEntry) -> ModelObject:
    fields = {k: v for k, v in entry.details.items() if k in ModelObject.model_fields}
    return ModelObject(id=entry.id, created=entry.created, owned_by=entry.owned_by, **fields)


@router.get("", response_model=ModelList)
def list_models(session: SessionDep, tenant: TenantDep, settings: SettingsDep) -> ModelList:
    """Base models (with what each is and what can train on it), then the tenant's own fine-tuned models
    and Tinker checkpoints (which can be trained further)."""
    data = [_base_object(e) for e in list_base_models(settings, session)]
    data += [
        ModelObject(id=name, created=created, owned_by=tenant.id)
        for name, created in list_fine_tuned(session, tenant_id=tenant.id)
        + list_tinker_models(session, tenant_id=tenant.id)
    ]
    return ModelList(data=data)


@router.get("/{model_id:path}", response_model=ModelObject, responses=error_responses(404))
def retrieve_model(
    model_id: str, session: SessionDep, tenant: TenantDep, settings: SettingsDep
) -> ModelObject:
    ckpt = find_final_checkpoint(session, tenant_id=tenant.id, name=model_id)
    if ckpt is not None:
        return ModelObject(id=model_id, created=ckpt.created_at, owned_by=tenant.id)
    tinker = find_tinker_checkpoint(session, tenant_id=tenant.id, name=model_id)
    if tinker is not None:
        return ModelObject(id=model_id, created=tinker.created_at, owned_by=tenant.id)
    entry = resolve_base_model(settings, model_id, session)
    if entry is None:
        raise NotFound(
            unknown_model_message(settings, model_id, session), param="model", code="model_not_found"
        )
    return _base_object(entry)


@router.delete("/{model_id:path}", response_model=ModelDeleted, responses=error_responses(403, 404))
def delete_model(
    model_id: str, session: SessionDep, tenant: TenantDep, settings: SettingsDep
) -> ModelDeleted:
    """Delete one of the organization's fine-tuned models; its job keeps its history."""
    if not model_id.startswith("ft:") and resolve_base_model(settings, model_id, session) is not None:
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
