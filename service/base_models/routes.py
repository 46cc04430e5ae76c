"""GET /v1/models: the base models this deployment can fine-tune, in OpenAI's list shape."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.auth import TenantDep
from service.base_models.catalog import BUILTIN_CREATED_AT, list_base_models, resolve_base_model
from service.base_models.fine_tuned import find_final_checkpoint, list_fine_tuned
from service.dependencies import SessionDep, SettingsDep
from service.errors import NotFound

router = APIRouter(prefix="/v1/models", tags=["models"])


def _model_object(entry_id: str, owned_by: str) -> dict[str, Any]:
    return {"id": entry_id, "object": "model", "created": BUILTIN_CREATED_AT, "owned_by": owned_by}


@router.get("")
def list_models(session: SessionDep, tenant: TenantDep, settings: SettingsDep) -> dict[str, Any]:
    """Base models, then the tenant's own fine-tuned models (which can be trained further)."""
    data = [_model_object(e.id, e.owned_by) for e in list_base_models(settings)]
    data += [
        {"id": name, "object": "model", "created": created, "owned_by": tenant.id}
        for name, created in list_fine_tuned(session, tenant_id=tenant.id)
    ]
    return {"object": "list", "data": data}


@router.get("/{model_id:path}")
def retrieve_model(
    model_id: str, session: SessionDep, tenant: TenantDep, settings: SettingsDep
) -> dict[str, Any]:
    ckpt = find_final_checkpoint(session, tenant_id=tenant.id, name=model_id)
    if ckpt is not None:
        return {"id": model_id, "object": "model", "created": ckpt.created_at, "owned_by": tenant.id}
    entry = resolve_base_model(settings, model_id)
    if entry is None:
        raise NotFound(f"The model '{model_id}' does not exist", param="model", code="model_not_found")
    return _model_object(entry.id, entry.owned_by)
