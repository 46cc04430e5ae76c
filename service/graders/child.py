"""The process a grader run (POST /v1/fine_tuning/alpha/graders/run) grades in, away from the API.

Grading is CPU-bound Python (difflib, BLEU, template expansion): run in the API process it held the
GIL and the memory of every other request (issue 46). The API starts this module per run as
`python -I -S` under the limits a training-time python grader gets (`python_grader_timeout_seconds`
of CPU and of wall time, `python_grader_memory_mb` of address space: service/graders/service.py) and
reads one JSON reply. It imports only the stdlib and `trainers.rewards.graders`, the reward functions RL jobs
train with, so it starts far sooner than a process that imports the service.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

# Run by the API as `python -I -S -c BOOT <import root> <address-space bytes> <cpu seconds>`: limits
# first, then this module. -I -S: no user site, no environment, no site-packages (nothing is needed).
BOOT = r"""
import resource, sys
root, memory, cpu = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
sys.path.insert(0, root)
from service.graders.child import main
main()
"""


def grade(
    spec: dict[str, Any], model_sample: str, item: dict[str, Any], options: dict[str, Any]
) -> dict[str, Any]:
    """Score `model_sample` against `item`: {"reward", "sub_rewards", "errors"}, or {"bad_request":
    {"param", "message"}} when a template cannot be filled (the request's fault)."""
    from trainers.rewards.formula import eval_formula
    from trainers.rewards.graders import GraderError, PythonGrader, build_grader, parse_formula

    errors: dict[str, Any] = {}
    columns = {key: [value] for key, value in item.items()}

    def score(sub_spec: dict[str, Any], param: str) -> float:
        fn = build_grader(sub_spec, param=param, **options)
        try:
            return float(fn([""], [model_sample], **columns)[0] or 0.0)
        except GraderError as exc:
            if not isinstance(fn, PythonGrader):
                raise
            # as OpenAI: the tenant's code failing is a result (reward 0 and the details), not a 4xx
            errors["python_grader_runtime_error"] = True
            errors["python_grader_runtime_error_details"] = exc.message
            return 0.0

    try:
        sub_rewards: dict[str, float] = {}
        if spec["type"] == "multi":
            sub_rewards = {
                name: score(sub, f"grader.graders.{name}") for name, sub in spec["graders"].items()
            }
            tree = parse_formula(spec["calculate_output"], list(sub_rewards), param="grader.calculate_output")
            reward = eval_formula(tree, sub_rewards)
        else:
            reward = score(spec, "grader")
    except GraderError as exc:
        return {"bad_request": {"param": exc.param, "message": exc.message}}
    return {"reward": reward, "sub_rewards": sub_rewards, "errors": errors}


def main() -> None:
    payload = json.loads(sys.stdin.read())
    from trainers.rewards.sandbox import SandboxUnavailable

    try:
        result = grade(payload["grader"], payload["model_sample"], payload["item"], payload["options"])
    except MemoryError:
        result = {"limit": "memory"}
    except SandboxUnavailable as exc:  # the host's fault, not the request's: the API answers 503
        result = {"sandbox_unavailable": str(exc)}
    sys.stdout.write(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)
