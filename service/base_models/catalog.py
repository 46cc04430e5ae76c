"""The base models this deployment can train: the bundled tiny demo model always, the operator's
catalogue (`tunehouse models add`: stored once in the blob store, service/base_models/adding.py), the
registry of local paths (`TUNEHOUSE_MODEL_REGISTRY='{"name": "/path"}'`), and hub ids when the host is
online (`TUNEHOUSE_ALLOW_HUB_MODELS`). An unknown name's refusal says how to add it, and the names it is
closest to (`unknown_model_message`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.base_models.details import trainable
from service.config import Settings
from service.db import session_scope
from service.models import CatalogModel
from service.suggest import did_you_mean
from trainers.tiny_spec import CHAT_TEMPLATE, TINY_MODEL_NAME

# the tiny model: built on first use by the worker (trainers.modeling.tiny_model), so the repo carries no
# weights
BUILTIN_CREATED_AT = 1_767_225_600  # 2026-01-01, a fixed date so listings are stable
# what trainers/modeling/tiny_model.py builds, as service/base_models/details.py reads it from the built
# folder (tests/service/test_model_catalogue.py builds it and compares)
TINY_MODEL_DETAILS: dict[str, Any] = {
    "architecture": "LlamaForCausalLM",
    "model_type": "llama",
    "parameters": 139_584,
    "context_length": 2048,
    "modalities": ["text"],
}


@dataclass(frozen=True)
class BaseModelEntry:
    id: str
    source: str  # "builtin" | "catalogue" | "local" | "hub"
    path: str | None  # a registry entry's folder
    owned_by: str
    created: int = BUILTIN_CREATED_AT
    details: dict[str, Any] = field(default_factory=dict)
    row: CatalogModel | None = None  # a catalogue entry's row: its revision, files and blobs


def _tiny() -> BaseModelEntry:
    details = {**TINY_MODEL_DETAILS, "chat_template": CHAT_TEMPLATE}
    details["trainable"] = trainable(details["architecture"])
    return BaseModelEntry(TINY_MODEL_NAME, "builtin", None, "tunehouse", details=details)


def _catalogue(session: Session | None) -> list[CatalogModel]:
    stmt = select(CatalogModel).order_by(CatalogModel.id)
    if session is not None:
        return list(session.execute(stmt).scalars())
    with session_scope() as own:
        rows = list(own.execute(stmt).scalars())
        own.expunge_all()
    return rows


def _entry(row: CatalogModel) -> BaseModelEntry:
    details = {**row.details, "revision": row.revision, "source": row.source, "bytes": row.bytes}
    return BaseModelEntry(row.id, "catalogue", None, "operator", row.created_at, details, row)


def list_base_models(settings: Settings, session: Session | None = None) -> list[BaseModelEntry]:
    entries = [_tiny()]
    entries += [_entry(row) for row in _catalogue(session)]
    entries += [
        BaseModelEntry(name, "local", path, "operator")
        for name, path in sorted(settings.model_registry.items())
        if name not in {e.id for e in entries}
    ]
    return entries


def resolve_base_model(
    settings: Settings, name: str, session: Session | None = None
) -> BaseModelEntry | None:
    for entry in list_base_models(settings, session):
        if entry.id == name:
            return entry
    if settings.allow_hub_models and name.count("/") == 1 and not name.startswith(("/", ".")):
        return BaseModelEntry(name, "hub", None, "hub")
    return None


def unknown_model_message(settings: Settings, name: str, session: Session | None = None) -> str:
    """Why `name` is not a base model here and how an operator adds it."""
    known = [e.id for e in list_base_models(settings, session)]
    return (
        f"model '{name}' is not a base model of this deployment{did_you_mean(name, known)}; "
        f"GET /v1/models lists them. An operator adds one with `tunehouse models add {name}` "
        "(a hub id, with HF_TOKEN for a gated model, or a local folder)"
    )
