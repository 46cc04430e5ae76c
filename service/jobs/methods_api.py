"""Extension: `GET /v1/methods` — the training methods this deployment runs, each with its
hyperparameters as JSON Schema (defaults, ranges, choices, docs), the file formats it accepts and
the metrics its trainer reports.

Derived, not declared: everything comes from the method registry (`trainers.registry`) and the
pydantic models built from it (`service.jobs.spec.BODIES`) that validate `POST /v1/fine_tuning/jobs`,
so a form built from it (the dashboard's new-job form) offers exactly what the API accepts.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from service.auth import TenantDep
from service.errors import error_responses
from service.jobs.spec import BODIES
from trainers.registry import METHODS
from trainers.registry import Method as MethodDeclaration

router = APIRouter(prefix="/v1/methods", tags=["methods"], responses=error_responses(400, 401, 503))


def _hyperparameter_schema(m: MethodDeclaration) -> dict[str, Any]:
    model = BODIES[m.name].model_fields["hyperparameters"].annotation
    assert isinstance(model, type) and issubclass(model, BaseModel), m.name
    schema = model.model_json_schema()
    for p in m.hyperparameters:
        schema["properties"][p.name].setdefault("description", p.doc)
    return schema


@cache
def _methods() -> list[dict[str, Any]]:
    return [
        {
            "id": m.name,
            "object": "method",
            "summary": m.summary,
            "grader": m.grader,
            "file_formats": list(m.formats),
            # beyond the loop's own (loss, learning_rate, grad_norm, ...); "{grader}" is each grader's name
            "metrics": list(m.metrics + m.eval_metrics),
            "hyperparameters": _hyperparameter_schema(m),
        }
        for m in METHODS.values()
    ]


@router.get("")
def list_methods(_tenant: TenantDep) -> dict[str, Any]:
    return {"object": "list", "data": _methods()}
