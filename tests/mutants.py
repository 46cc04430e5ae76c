"""Mutation check (`make mutants`): mutmut mutates one module at a time and runs the tests that guard it.

    make mutants                                   # the DEFAULT modules below (~45 min on 2 cores)
    make mutants MODULES="trainers/methods/grpo.py"        # any module listed in GUARDS
    python -m tests.mutants trainers/losses/causal_lm.py     # the same, without make
    python -m tests.mutants --recheck trainers/core/loop.py tests/trainers/core/test_loop.py
        # after writing tests for a finished run's survivors: each survivor tried again, in a fresh
        # process, against those test files as they are now (minutes, not a new full run)

For each module it prints the score (killed / mutants tried) and every surviving mutant as a diff. A
survivor is a change to the code that no test noticed: kill it with a test, or, if it cannot change
behaviour, list it in docs/testing.md as equivalent, with why. Not in `.ci/run`: it runs the module's
tests once per mutant (mutmut forks after one import, but the RL and loop tests still take minutes).

Each module gets its own copy of the project under MUTANTS_DIR (default /tmp/tunehouse-mutants), with
a `[tool.mutmut]` section naming that module and its tests; mutmut remembers finished mutants there, so
an interrupted run resumes. The tests need PostgreSQL and Redis as for `make test`
(TUNEHOUSE_TEST_REDIS / TUNEHOUSE_TEST_POSTGRES are passed through).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("MUTANTS_DIR", "/tmp/tunehouse-mutants"))

# module -> the tests that decide whether a change to it is caught
GUARDS: dict[str, list[str]] = {
    "trainers/losses/causal_lm.py": [
        "tests/trainers/losses/test_losses.py",
        "tests/trainers/methods/test_sft_training.py",
    ],
    "service/jobs/lifecycle.py": ["tests/worker/test_lease.py"],
    "service/jobs/spec.py": ["tests/service/test_job_spec.py", "tests/worker/test_methods.py"],
    "service/jobs/creation.py": ["tests/service/test_job_creation.py"],
    "service/jobs/transitions.py": ["tests/service/test_job_transitions.py"],
    "service/files/validation.py": ["tests/service/test_file_validation.py"],
    "trainers/data/collate.py": ["tests/trainers/data/test_data.py", "tests/trainers/data/test_packing.py"],
    "trainers/losses/advantages.py": ["tests/trainers/losses/test_advantages.py"],
    "trainers/losses/rl.py": ["tests/trainers/losses/test_rl_losses.py"],
    "trainers/data/example_store.py": ["tests/trainers/data/test_example_store.py"],
    "trainers/data/jsonl_rows.py": ["tests/trainers/data/test_jsonl_rows.py"],
    "trainers/losses/preference.py": [
        "tests/trainers/methods/test_reference_free.py::test_loss_equals_trl",
        "tests/trainers/methods/test_reference_free.py::test_losses_by_hand",
        "tests/trainers/methods/test_reference_free.py::test_log1mexp_is_accurate_on_both_sides_of_its_switch",
        "tests/trainers/methods/test_reference_free.py::test_defaults_are_the_papers",
        "tests/trainers/methods/test_kto.py::test_kto_loss_equals_trl",
        "tests/trainers/methods/test_kto.py::test_kto_loss_by_hand",
    ],
    "trainers/methods/grpo.py": ["tests/trainers/methods/test_grpo.py"],
    "trainers/methods/ppo.py": ["tests/trainers/methods/test_ppo.py"],
    "trainers/methods/dpo.py": ["tests/trainers/methods/test_dpo.py"],
    "trainers/families/rl.py": ["tests/trainers/families/test_rl.py", "tests/trainers/methods/test_grpo.py"],
    "trainers/rewards/graders.py": ["tests/trainers/rewards/test_rewards.py"],
    "trainers/core/loop.py": [
        "tests/trainers/core/test_loop.py",
        "tests/trainers/methods/test_sft_training.py",
        "tests/trainers/core/test_resume.py",
        "tests/trainers/core/test_checkpoint_policy.py",
        "tests/trainers/core/test_schedule.py",
        # a rollout preparer reused over steps (RLOO), a value head trained alongside (PPO)
        "tests/trainers/methods/test_rloo.py::test_resume_repeats_the_uninterrupted_run",
        "tests/trainers/methods/test_ppo.py::test_resume_repeats_the_uninterrupted_run",
    ],
    "trainers/core/checkpoint.py": [
        "tests/trainers/core/test_checkpoint.py",
        "tests/trainers/core/test_resume.py",
        "tests/trainers/core/test_checkpoint_policy.py",
    ],
}
# the modules whose guarding tests take seconds (~45 min in all on 2 cores); the trainers' training
# code (grpo.py, ppo.py, loop.py, ...) retrains the tiny model per mutant: name it to run it
DEFAULT = [
    "trainers/losses/causal_lm.py",
    "trainers/losses/rl.py",
    "trainers/losses/preference.py",
    "trainers/losses/advantages.py",
    "trainers/data/collate.py",
    "trainers/rewards/graders.py",
    "service/jobs/lifecycle.py",
    "service/files/validation.py",
    "service/jobs/spec.py",
    "service/jobs/transitions.py",
    "service/jobs/creation.py",
    "trainers/data/example_store.py",
    "trainers/data/jsonl_rows.py",
]
COPIED = (
    "service",
    "worker",
    "trainers",
    "tunehouse",
    "tests",
    "migrations",
    "alembic.ini",
    "pyproject.toml",
)


def _work_dir(module: str) -> Path:
    return WORK / module.replace("/", "_").removesuffix(".py")


def _prepare(module: str) -> Path:
    work = _work_dir(module)
    work.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        src, dest = ROOT / name, work / name
        if src.is_dir():
            shutil.copytree(src, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest)
    tests = ", ".join(f'"{t}"' for t in GUARDS[module])
    top = module.split("/")[0]
    others = ", ".join(f'"{n}"' for n in COPIED if n not in (top, "tests", "pyproject.toml"))
    section = (
        "\n[tool.mutmut]\n"
        f'source_paths = ["{top}"]\n'
        f'only_mutate = ["{module}"]\n'
        f"also_copy = [{others}]\n"
        f"pytest_add_cli_args_test_selection = [{tests}]\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q"]\n'
    )
    pyproject = work / "pyproject.toml"
    pyproject.write_text(pyproject.read_text(encoding="utf-8") + section, encoding="utf-8")
    return work


# mutmut forks a child per mutant after importing the tests once. A child forked after torch started its
# OpenMP thread pool can hang in its first parallel op: every mutant the tests did not kill at once then
# ended as a timeout. One intra-op thread means no pool to inherit.
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _mutmut(work: Path, *args: str, capture: bool = False) -> str:
    exe = Path(sys.executable).with_name("mutmut")
    env = {**os.environ, **SINGLE_THREADED}
    out = subprocess.run([str(exe), *args], cwd=work, text=True, capture_output=capture, check=False, env=env)
    return out.stdout if capture else ""


# mutmut imports the tests once and forks a child per mutant, which switches the mutant on: code that
# runs only at import (spec.py builds its pydantic models from the registry then) was already run with
# the original. In these modules each survivor is tried once more in a fresh process, mutant on from
# the start. (Only these: elsewhere a retry would rerun every guarding test per survivor, minutes each
# for the trainers, and could not change the verdict.)
RUNS_AT_IMPORT = {"service/jobs/spec.py"}
FRESH_TIMEOUT_SECONDS = 600


def _fails_in_a_fresh_process(work: Path, module: str, name: str, tests: list[str] | None = None) -> bool:
    env = {**os.environ, **SINGLE_THREADED, "MUTANT_UNDER_TEST": name}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        *(tests or GUARDS[module]),
    ]
    try:
        done = subprocess.run(
            command, cwd=work / "mutants", env=env, capture_output=True, timeout=FRESH_TIMEOUT_SECONDS
        )
    except subprocess.TimeoutExpired:
        return False  # a hang is noticed, but counted as a timeout, not a kill
    # 1: a test failed; 2: the mutant broke the import (collection error); 0: all passed
    return done.returncode in (1, 2)


def _statuses(work: Path) -> dict[str, str]:
    """mutant name -> status, as mutmut recorded them in ``work``."""
    results = _mutmut(work, "results", "--all", "true", capture=True)
    return {n: s.strip() for n, s in re.findall(r"^\s*(\S+__mutmut_\d+): (.+)$", results, flags=re.MULTILINE)}


def run(module: str) -> tuple[int, int, list[str]]:
    """(killed, tried, survivors' names) of one module, after running its mutants."""
    work = _prepare(module)
    _mutmut(work, "run")
    statuses = _statuses(work)
    # a mutant no guarding test runs ("no tests") is a change nothing notices: it counts as surviving,
    # unless a fresh process (above) kills it
    for name, status in statuses.items():
        fresh = module in RUNS_AT_IMPORT and status in ("survived", "no tests")
        if fresh and _fails_in_a_fresh_process(work, module, name):
            statuses[name] = "killed at import"
    survivors = sorted(
        n for n, s in statuses.items() if s in ("survived", "suspicious", "timeout", "no tests")
    )
    tried = [s for s in statuses.values() if s not in ("not checked", "skipped")]
    killed = sum(s in ("killed", "killed at import") for s in statuses.values())
    at_import = sum(s == "killed at import" for s in statuses.values())
    for name in survivors:
        print(f"\n--- {name} ({statuses[name]})")
        print(_mutmut(work, "show", name, capture=True).rstrip())
    if module in RUNS_AT_IMPORT:
        print(f"\n{module}: {at_import} mutants killed only in a fresh process (code run at import)")
    return killed, len(tried), survivors


def recheck(module: str, tests: list[str]) -> int:
    """Try each survivor of ``module``'s last run again in a fresh process against ``tests`` as they are
    in this checkout now; print the survivors left and the score with the rechecked kills counted."""
    work = _work_dir(module)
    statuses = _statuses(work)
    for test in tests:  # the new tests replace the copies the run started with
        shutil.copy2(ROOT / test, work / "mutants" / test)
    left = []
    for name, status in sorted(statuses.items()):
        if status not in ("survived", "suspicious", "timeout", "no tests"):
            continue
        if _fails_in_a_fresh_process(work, module, name, tests=tests):
            statuses[name] = "killed on recheck"
        else:
            left.append(name)
            print(f"\n--- {name} ({status})")
            print(_mutmut(work, "show", name, capture=True).rstrip())
    tried = [s for s in statuses.values() if s not in ("not checked", "skipped")]
    killed = sum(s in ("killed", "killed on recheck") for s in statuses.values())
    rechecked = sum(s == "killed on recheck" for s in statuses.values())
    score = 100.0 * killed / len(tried) if tried else 0.0
    print(
        f"\n{module}: {killed}/{len(tried)} killed ({score:.1f}%), {rechecked} on recheck, {len(left)} left"
    )
    return 0


def main(modules: list[str]) -> int:
    unknown = [m for m in modules if m not in GUARDS]
    if unknown:
        print(f"no tests are declared for {unknown} in tests/mutants.py GUARDS", file=sys.stderr)
        return 2
    summary = []
    for module in modules:
        killed, tried, survivors = run(module)
        score = 100.0 * killed / tried if tried else 0.0
        summary.append(f"{module}: {killed}/{tried} killed ({score:.1f}%), {len(survivors)} survived")
    print("\nmutation score per module")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--recheck"]:
        raise SystemExit(recheck(sys.argv[2], sys.argv[3:]))
    raise SystemExit(main(sys.argv[1:] or DEFAULT))
