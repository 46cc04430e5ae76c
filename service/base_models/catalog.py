"""The base models this deployment can train: the bundled tiny demo model always, plus the operator's
registry (`TUNEHOUSE_MODEL_REGISTRY='{"name": "/path"}'`), plus hub ids when the host is online."""

from __future__ import annotations

from dataclasses import dataclass

from service.config import Settings

# Built on first use by the worker (trainers.modeling.tiny_model), so the repo carries no weights.
TINY_MODEL_NAME = "tunehouse/tiny-llama"
BUILTIN_CREATED_AT = 1_767_225_600  # 2026-01-01, a fixed date so listings are stable


@dataclass(frozen=True)
class BaseModelEntry:
    id: str
    source: str  # "builtin" | "local" | "hub"
    path: str | None
    owned_by: str


def list_base_models(settings: Settings) -> list[BaseModelEntry]:
    entries = [BaseModelEntry(TINY_MODEL_NAME, "builtin", None, "tunehouse")]
    entries += [
        BaseModelEntry(name, "local", path, "operator")
        for name, path in sorted(settings.model_registry.items())
    ]
    return entries


def resolve_base_model(settings: Settings, name: str) -> BaseModelEntry | None:
    for entry in list_base_models(settings):
        if entry.id == name:
            return entry
    if settings.allow_hub_models and name.count("/") == 1 and not name.startswith(("/", ".")):
        return BaseModelEntry(name, "hub", None, "hub")
    return None
