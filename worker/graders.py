"""An RL job's grader as reward functions: model names become local paths, then
trainers.rewards.graders.build_grader does the rest (with the operator's Python-grader policy)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.config import Settings
from service.jobs.spec import MethodBase
from service.storage import BlobStore
from worker.models import resolve_model_path

if TYPE_CHECKING:
    from trainers.rewards.reward_set import RewardSet


def _resolve_models(spec: dict[str, Any], resolve: Any, param: str) -> dict[str, Any]:
    if spec.get("type") == "score_model":
        return {**spec, "model": resolve(spec["model"], f"{param}.model")}
    if spec.get("type") == "multi":
        graders = {k: _resolve_models(g, resolve, f"{param}.graders.{k}") for k, g in spec["graders"].items()}
        return {**spec, "graders": graders}
    return spec


def reward_set(
    method: MethodBase, *, settings: Settings, blobs: BlobStore, tenant_id: str
) -> RewardSet | None:
    """The job's grader as a one-function reward set named after the grader; None without a grader."""
    if method.grader is None:
        return None
    from trainers.rewards.graders import build_grader
    from trainers.rewards.reward_set import RewardSet

    param = f"method.{method.type}.grader"

    def resolve(name: str, where: str) -> str:
        return resolve_model_path(
            settings,
            blobs,
            tenant_id=tenant_id,
            name=name,
            param=where,
            reward_model=True,
            include_deleted=True,  # the job's own grader: kept for it while it runs
        )

    spec = _resolve_models(method.grader.model_dump(mode="json"), resolve, param)
    grader = build_grader(
        spec,
        allow_python=settings.allow_python_grader,
        python_timeout=settings.python_grader_timeout_seconds,
        python_memory_mb=settings.python_grader_memory_mb,
        param=param,
    )
    return RewardSet.of([grader], names=[str(spec.get("name", "grader"))])
