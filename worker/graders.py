"""An RL job's grader as reward functions: model names become local paths, then
trainers.rewards.graders.build_grader does the rest (with the operator's Python-grader policy)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.config import Settings
from service.graders.limits import expansion_problem
from service.jobs.spec import MethodBase
from service.storage import BlobStore
from worker.models import resolve_model_path

if TYPE_CHECKING:
    from trainers.rewards.graders import RewardFunc
    from trainers.rewards.reward_set import RewardSet


class _ExpansionChecked:
    """The job's grader, each row's templates measured before they are built: a row whose `{{item.x}}`
    would expand past `grader_max_text_chars` fails the job as a data error naming the field, instead
    of building it (issue 46: 5,000 copies of a 100 KB field are 500 MB). The completion counts as
    empty: its length is the job's own generation limit, not the data's fault."""

    def __init__(self, fn: RewardFunc, spec: dict[str, Any], *, param: str, max_chars: int) -> None:
        self.__name__ = getattr(fn, "__name__", "grader")
        self.fn, self.spec, self.param, self.max_chars = fn, spec, param, max_chars

    def __call__(
        self, prompts: list[str], completions: list[str], **columns: list[Any]
    ) -> list[float | None]:
        from trainers.rewards.graders import GraderError

        for i in range(len(completions)):
            item = {key: values[i] for key, values in columns.items()}
            problem = expansion_problem(
                self.spec,
                param=self.param,
                sample_chars=0,
                item=item,
                max_text_chars=self.max_chars,
                subject="a row of the training file",
            )
            if problem is not None:
                raise GraderError(f"{problem[0]}: {problem[1]}", problem[0])
        return list(self.fn(prompts, completions, **columns))


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
        python_sandbox=not settings.python_grader_unsafe_no_sandbox,
        param=param,
    )
    checked = _ExpansionChecked(grader, spec, param=param, max_chars=settings.grader_max_text_chars)
    return RewardSet.of([checked], names=[str(spec.get("name", "grader"))])
