"""Rules for graders: check one (for the graders API and for an RL job's spec) and run one on a sample.

Checking goes beyond the pydantic shapes (service/jobs/graders.py):
`trainers.rewards.graders.validate_grader`,
the check the worker runs before grading, catches what only it knows (template variables, sub-grader
names, Python source that does not compile), so a grader that passes here cannot fail the job for its
form later. Running reuses `trainers.rewards.graders.build_grader`, the reward functions RL jobs train with.
`trainers.rewards.graders` imports no torch (a `score_model` grader would, which is why /run refuses those).
"""

from __future__ import annotations

import math
import time
from typing import Any

from pydantic import BaseModel
from sqlalchemy.orm import Session

from service.base_models.fine_tuned import find_final_checkpoint
from service.config import Settings
from service.errors import BadRequest, NotImplementedYet
from service.graders.schemas import GraderRunResponse, RunErrors, RunMetadata
from service.jobs.graders import python_graders, score_models
from service.models import Tenant


def check_grader(
    session: Session, *, tenant: Tenant, grader: BaseModel, settings: Settings, param: str
) -> None:
    """400 naming the field at fault (`param` + its path) if `grader` cannot run for this tenant."""
    from trainers.rewards.graders import GraderError, validate_grader

    if python_graders(grader) and not settings.allow_python_grader:
        raise BadRequest(
            "python graders are disabled on this deployment (the operator enables them with "
            "TUNEHOUSE_ALLOW_PYTHON_GRADER=1)",
            param=f"{param}.type",
            code="python_grader_disabled",
        )
    for name in score_models(grader):
        if find_final_checkpoint(session, tenant_id=tenant.id, name=name, reward_model=True) is None:
            raise BadRequest(
                f"score_model grader: '{name}' is not a reward model of this organization "
                "(train one with method 'reward_model' and use its fine_tuned_model)",
                param=f"{param}.model",
                code="model_not_available",
            )
    try:
        validate_grader(grader.model_dump(mode="json"), param=param, allow_python=True)
    except GraderError as exc:
        raise BadRequest(f"{exc.param}: {exc.message}", param=exc.param, code="invalid_grader") from exc


def run_grader(
    grader: BaseModel, *, model_sample: str, item: dict[str, Any], settings: Settings
) -> GraderRunResponse:
    """Score `model_sample` against `item`: the reward, and each sub-grader's score for a `multi`."""
    from trainers.rewards.formula import eval_formula
    from trainers.rewards.graders import GraderError, PythonGrader, build_grader, parse_formula

    if score_models(grader):
        raise NotImplementedYet(
            "score_model graders are not run by this endpoint yet: they need a reward model loaded on a "
            "worker; try one in a short RL job",
            param="grader.type",
            code="not_implemented",
        )
    spec = grader.model_dump(mode="json")
    options = {
        "allow_python": settings.allow_python_grader,
        "python_timeout": settings.python_grader_timeout_seconds,
        "python_memory_mb": settings.python_grader_memory_mb,
    }
    errors = RunErrors()
    columns = {key: [value] for key, value in item.items()}
    started = time.perf_counter()

    def score(sub_spec: dict[str, Any], param: str) -> float:
        fn = build_grader(sub_spec, param=param, **options)  # type: ignore[arg-type]
        try:
            return float(fn([""], [model_sample], **columns)[0] or 0.0)
        except GraderError as exc:
            if not isinstance(fn, PythonGrader):  # a template the item cannot fill: the request's fault
                raise BadRequest(
                    f"{exc.param}: {exc.message}", param=exc.param, code="invalid_grader"
                ) from exc
            # as OpenAI: the tenant's code failing is a result (reward 0 and the details), not a 4xx
            errors.python_grader_runtime_error = True
            errors.python_grader_runtime_error_details = exc.message
            return 0.0

    sub_rewards: dict[str, float] = {}
    if spec["type"] == "multi":
        sub_rewards = {name: score(sub, f"grader.graders.{name}") for name, sub in spec["graders"].items()}
        tree = parse_formula(spec["calculate_output"], list(sub_rewards), param="grader.calculate_output")
        reward = eval_formula(tree, sub_rewards)
    else:
        reward = score(spec, "grader")
    if not math.isfinite(reward):
        raise BadRequest(
            f"grader.calculate_output: the formula gives {reward} for these scores "
            f"({', '.join(f'{k}={v:g}' for k, v in sub_rewards.items())}), e.g. a division by zero",
            param="grader.calculate_output",
            code="invalid_grader",
        )
    return GraderRunResponse(
        metadata=RunMetadata(
            errors=errors,
            execution_time=time.perf_counter() - started,
            name=spec["name"],
            scores={spec["name"]: reward, **sub_rewards},
            type=spec["type"],
        ),
        reward=reward,
        sub_rewards=sub_rewards,
    )
