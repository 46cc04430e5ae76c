"""What a model name can take (text, or text and images), as the API knows it before any worker loads it:
``trainers.modalities`` read from the model's ``config.json`` (a catalogue model's details hold it, read
when it was added; an operator's registry entry is read from its folder), the built-in tiny model's
text, a fine-tuned model's base's (its job's, or its Tinker checkpoint's), and unknown (None) for a hub
id not downloaded yet, whose worker then decides.

The job creation refuses image rows on a model that takes none (service/jobs/creation.py); the model
catalogue can list the same ``modalities`` (GET /v1/models).
"""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.base_models.catalog import resolve_base_model
from service.base_models.fine_tuned import find_final_checkpoint
from service.base_models.tinker_checkpoints import find_tinker_checkpoint
from service.config import Settings
from service.models import Job
from trainers.modalities import TEXT, modalities

# a fine-tuned model of a fine-tuned model of ...: its base is found within this many hops
_MAX_DEPTH = 16


def model_modalities(
    session: Session, settings: Settings, *, tenant_id: str, name: str
) -> tuple[str, ...] | None:
    """The inputs model ``name`` takes, or None where the API cannot tell (module docstring)."""
    for _ in range(_MAX_DEPTH):
        entry = resolve_base_model(settings, name, session)
        if entry is not None:
            if entry.details.get("modalities"):
                return tuple(entry.details["modalities"])
            if entry.source == "builtin":
                return (TEXT,)
            return _from_folder(Path(entry.path)) if entry.path else None
        tinker = find_tinker_checkpoint(session, tenant_id=tenant_id, name=name)
        if tinker is not None:
            name = tinker.base_model
            continue
        checkpoint = find_final_checkpoint(session, tenant_id=tenant_id, name=name, include_deleted=True)
        if checkpoint is None:
            return None
        base = session.scalar(select(Job.model).where(Job.id == checkpoint.job_id))
        if base is None:
            return None
        name = base
    return None


def _from_folder(folder: Path) -> tuple[str, ...] | None:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # not on this host (a worker's folder), or not a model yet
    return modalities(config) if isinstance(config, dict) else None
