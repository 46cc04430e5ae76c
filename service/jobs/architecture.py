"""Refuse at job creation a feature the model's architecture cannot take (``trainers.architectures``: the
one rule, e.g. no packing for gpt-oss), as a 400 naming the hyperparameter.

The architecture is the ``model_type`` of the model's config.json, read as JSON (no torch, no download):
for an operator's registered model from its folder, for a fine-tuned model (``ft:``, a Tinker checkpoint)
from the base it was trained from. Where there is no config.json here (a hub id, the built-in tiny model
before its first build, a folder without one) nothing is refused here: the trainer makes the same check
when it has the model (``trainers.families.entry.begin_training``), and the job fails with the same
parameter named.
"""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy.orm import Session

from service.base_models.catalog import resolve_base_model
from service.base_models.fine_tuned import find_final_checkpoint
from service.base_models.tinker_checkpoints import find_tinker_checkpoint
from service.config import Settings
from service.jobs.spec import Method, resolved_values
from service.models import Job
from trainers.architectures import problem


def architecture_problem(
    session: Session, *, tenant_id: str, settings: Settings, model: str, method: Method
) -> tuple[str, str] | None:
    """(param, message) of the first feature ``method``'s resolved hyperparameters ask for that
    ``model``'s architecture cannot take, else None."""
    found = problem(
        model_type(session, tenant_id=tenant_id, settings=settings, model=model), resolved_values(method)
    )
    if found is None:
        return None
    name, message = found
    return f"method.{method.type}.hyperparameters.{name}", message


def model_type(session: Session, *, tenant_id: str, settings: Settings, model: str) -> str | None:
    """``model``'s architecture where its config.json can be read here, else None."""
    if model.startswith("ft:"):
        checkpoint = find_final_checkpoint(session, tenant_id=tenant_id, name=model, include_deleted=True)
        if checkpoint is not None:
            job = session.get(Job, checkpoint.job_id)
            base = job.model if job is not None else None
        else:
            tinker = find_tinker_checkpoint(session, tenant_id=tenant_id, name=model)
            base = tinker.base_model if tinker is not None else None
        return model_type(session, tenant_id=tenant_id, settings=settings, model=base) if base else None
    entry = resolve_base_model(settings, model)
    if entry is None or entry.path is None:
        return None
    return config_model_type(Path(entry.path))


def config_model_type(folder: Path) -> str | None:
    """The ``model_type`` of the Hugging Face folder ``folder``'s config.json, None without a readable one."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    found = config.get("model_type") if isinstance(config, dict) else None
    return found if isinstance(found, str) else None
