"""Rules for graders: check one (for the graders API and for an RL job's spec) and run one on a sample.

Checking goes beyond the pydantic shapes (service/graders/shapes.py):
`trainers.rewards.graders.validate_grader`,
the check the worker runs before grading, catches what only it knows (template variables, sub-grader
names, Python source that does not compile), so a grader that passes here cannot fail the job for its
form later. Both check the sizes first (service/graders/limits.py). Running reuses
`trainers.rewards.graders.build_grader`, the reward functions RL jobs train with, in a child process under the
python grader's CPU, wall-time and memory limits (service/graders/child.py), never in the API's.
`trainers.rewards.graders` imports no torch (a `score_model` grader would, which is why /run refuses those).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from sqlalchemy.orm import Session

from service.base_models.fine_tuned import find_final_checkpoint
from service.config import Settings
from service.errors import BadRequest, NotImplementedYet, ServiceUnavailable
from service.graders import child, limits
from service.graders.schemas import GraderRunResponse, RunErrors, RunMetadata
from service.graders.shapes import python_graders, score_models
from service.models import Tenant

log = logging.getLogger("tunehouse.graders")


def check_grader(
    session: Session, *, tenant: Tenant, grader: BaseModel, settings: Settings, param: str
) -> None:
    """400 naming the field at fault (`param` + its path) if `grader` cannot run for this tenant."""
    from trainers.rewards.graders import GraderError, validate_grader

    spec = grader.model_dump(mode="json")
    problem = limits.spec_problem(
        spec,
        param=param,
        max_text_chars=settings.grader_max_text_chars,
        max_sub_graders=settings.grader_max_sub_graders,
    )
    if problem is not None:
        raise BadRequest(f"{problem[0]}: {problem[1]}", param=problem[0], code="grader_too_large")
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
        validate_grader(spec, param=param, allow_python=True)
    except GraderError as exc:
        raise BadRequest(f"{exc.param}: {exc.message}", param=exc.param, code="invalid_grader") from exc


class SandboxRefused(RuntimeError):
    """Python graders are enabled on a host that cannot sandbox them: the process must not start."""


def require_python_grader_sandbox(settings: Settings) -> None:
    """At the start of the API and of each training worker: with python graders enabled, the sandbox must
    work on this host (trainers/rewards/sandbox.py), or the operator must have chosen to run without it."""
    if not settings.allow_python_grader:
        return
    if settings.python_grader_unsafe_no_sandbox:
        log.warning(
            "TUNEHOUSE_PYTHON_GRADER_UNSAFE_NO_SANDBOX=1: tenants' python graders run WITHOUT a sandbox, "
            "as this service's uid, able to read its environment, files and network"
        )
        return
    from trainers.rewards.sandbox import unavailable

    reason = unavailable()
    if reason is not None:
        raise SandboxRefused(
            "TUNEHOUSE_ALLOW_PYTHON_GRADER=1 runs tenant code in a bubblewrap sandbox, which this host "
            f"cannot provide: {reason}. Install bubblewrap and allow the namespaces it needs "
            "(docs/operations.md#python-graders), or unset TUNEHOUSE_ALLOW_PYTHON_GRADER; "
            "TUNEHOUSE_PYTHON_GRADER_UNSAFE_NO_SANDBOX=1 runs tenant code unsandboxed (unsafe)"
        )


# The import root of `service` (and `trainers`): the child runs without site-packages, from here
_ROOT = str(Path(__file__).resolve().parents[2])
# the child's start and reply (a small fraction of this) on top of the grading's own wall time: a
# python grader that times out inside it reports its own timeout as a result, as it does in a job
_CHILD_SLACK_SECONDS = 2.0


def _check_sizes(
    spec: dict[str, Any], *, model_sample: str, item: dict[str, Any], settings: Settings
) -> None:
    if len(model_sample) > settings.grader_max_text_chars:
        raise BadRequest(
            f"model_sample: {len(model_sample)} characters; "
            f"at most {settings.grader_max_text_chars} are allowed",
            param="model_sample",
            code="grader_too_large",
        )
    if (size := limits.item_bytes(item)) > settings.grader_max_item_bytes:
        raise BadRequest(
            f"item: {size} bytes as JSON; at most {settings.grader_max_item_bytes} are allowed",
            param="item",
            code="grader_too_large",
        )
    problem = limits.expansion_problem(
        spec,
        param="grader",
        sample_chars=len(model_sample),
        item=item,
        max_text_chars=settings.grader_max_text_chars,
    )
    if problem is not None:
        raise BadRequest(f"{problem[0]}: {problem[1]}", param=problem[0], code="grader_too_large")


def _limit_exceeded(what: str) -> BadRequest:
    return BadRequest(
        f"grader: the run exceeded its {what} (the limits of a python grader, which the operator sets)",
        param="grader",
        code="grader_limit_exceeded",
    )


def _grade_in_child(payload: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """`child.grade` in a process of its own under the python grader's limits; its reply."""
    cpu_seconds = max(1, math.ceil(settings.python_grader_timeout_seconds))
    command = [
        sys.executable, "-I", "-S", "-c", child.BOOT,
        _ROOT, str(settings.python_grader_memory_mb << 20), str(cpu_seconds),
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PATH": os.environ.get("PATH", os.defpath)},  # where a python grader's sandbox finds bwrap
        start_new_session=True,  # its own group: a timeout kills a python grader's sandbox with it
    )
    try:
        out, err = proc.communicate(
            json.dumps(payload), timeout=settings.python_grader_timeout_seconds + _CHILD_SLACK_SECONDS
        )
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise _limit_exceeded(f"{settings.python_grader_timeout_seconds:g} s") from None
    if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # RLIMIT_CPU: soft, then hard
        raise _limit_exceeded(f"{cpu_seconds} s of CPU")
    try:
        reply: dict[str, Any] = json.loads(out)
    except json.JSONDecodeError:
        if "MemoryError" in err:
            raise _limit_exceeded(f"{settings.python_grader_memory_mb} MB of memory") from None
        raise RuntimeError(f"the grading child failed ({proc.returncode}): {err[-2000:]}") from None
    if "sandbox_unavailable" in reply:
        log.error("python grader sandbox unavailable: %s", reply["sandbox_unavailable"])
        raise ServiceUnavailable(
            "python graders cannot run on this server right now: its sandbox is unavailable",
            code="python_grader_sandbox_unavailable",
        )
    if reply.get("limit") == "memory":
        raise _limit_exceeded(f"{settings.python_grader_memory_mb} MB of memory")
    return reply


def run_grader(
    grader: BaseModel, *, model_sample: str, item: dict[str, Any], settings: Settings
) -> GraderRunResponse:
    """Score `model_sample` against `item`: the reward, and each sub-grader's score for a `multi`."""
    if score_models(grader):
        raise NotImplementedYet(
            "score_model graders are not run by this endpoint yet: they need a reward model loaded on a "
            "worker; try one in a short RL job",
            param="grader.type",
            code="not_implemented",
        )
    spec = grader.model_dump(mode="json")
    _check_sizes(spec, model_sample=model_sample, item=item, settings=settings)
    options = {
        "allow_python": settings.allow_python_grader,
        "python_timeout": settings.python_grader_timeout_seconds,
        "python_memory_mb": settings.python_grader_memory_mb,
        "python_sandbox": not settings.python_grader_unsafe_no_sandbox,
    }
    started = time.perf_counter()
    reply = _grade_in_child(
        {"grader": spec, "model_sample": model_sample, "item": item, "options": options}, settings
    )
    if "bad_request" in reply:  # a template the item cannot fill: the request's fault
        param, message = reply["bad_request"]["param"], reply["bad_request"]["message"]
        raise BadRequest(f"{param}: {message}", param=param, code="invalid_grader")
    reward, sub_rewards = float(reply["reward"]), dict(reply["sub_rewards"])
    if not math.isfinite(reward):
        raise BadRequest(
            f"grader.calculate_output: the formula gives {reward} for these scores "
            f"({', '.join(f'{k}={v:g}' for k, v in sub_rewards.items())}), e.g. a division by zero",
            param="grader.calculate_output",
            code="invalid_grader",
        )
    return GraderRunResponse(
        metadata=RunMetadata(
            errors=RunErrors(**reply["errors"]),
            execution_time=time.perf_counter() - started,
            name=spec["name"],
            scores={spec["name"]: reward, **sub_rewards},
            type=spec["type"],
        ),
        reward=reward,
        sub_rewards=sub_rewards,
    )
