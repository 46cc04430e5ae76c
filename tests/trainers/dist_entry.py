"""One rank of a data-parallel trainer run, for tests/trainers/core/test_distributed.py.

    python -m torch.distributed.run --standalone --nproc-per-node N -m tests.trainers.dist_entry SPEC

SPEC (JSON): ``method`` (a registry name), ``config`` (the config's fields), ``rows`` / ``valid_rows``
(JSONL paths), ``out`` (each rank writes ``{out}.rank{R}.json``: its recorded rows, checkpoints and
result), ``graders`` (an online method's reward functions, as grader specs), ``strategy`` (``ddp`` or
``fsdp``), and optionally ``kill`` = {"rank": R, "after_checkpoint": STEP}: that rank SIGKILLs itself
once the checkpoint of STEP is on disk, as an OOM kill would. Or ``{"runs": [SPEC, ...]}``: those runs
one after another in the same ranks and process group. Each launch costs two processes' imports (~6 s
of a 2-core host's wall time), which tests of many short runs pay once this way.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.trainers.helpers import Recorder
from trainers.core import distributed as dist
from trainers.core.checkpoint import checkpoint_dir
from trainers.registry import METHODS, resolve
from trainers.rewards.graders import build_grader
from trainers.rewards.reward_set import RewardSet


def _rows(path: str | None) -> list[dict[str, Any]] | None:
    if path is None:
        return None
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line]


def _kill_after(path: Path) -> None:
    def watch() -> None:
        while not path.is_dir():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    for run in spec.get("runs", [spec]):
        _run(run)
    # every rank done before any leaves: gloo's barrier also waits for the collectives still in flight.
    # Then the process ends without tearing the group down: a rank of an FSDP run aborted in that
    # teardown ("terminate called without an active exception", exit -6) after its run had ended and
    # its results were written, twice in CI under load (2026-11-27). The teardown of a real job's
    # ranks is worker/job_process's, exercised by tests/multi_gpu/test_multi_gpu_jobs.py.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(spec: dict[str, Any]) -> None:
    # the first run joins the group; the next ones only set their strategy
    dist.init_from_env(timeout_seconds=float(spec.get("timeout", 60)), strategy=spec.get("strategy", "ddp"))
    rank = dist.rank()
    method = METHODS[spec["method"]]
    config = resolve(method.config)(**spec["config"])
    kill = spec.get("kill")
    if kill is not None and kill["rank"] == rank:
        _kill_after(checkpoint_dir(config.output_dir, kill["after_checkpoint"]))
    rec = Recorder()
    train = resolve(method.trainer)
    graders = spec.get("graders")
    rewards = {"rewards": RewardSet.of([build_grader(g) for g in graders])} if graders else {}
    result = train(config, _rows(spec["rows"]), _rows(spec.get("valid_rows")), rec, **rewards)
    out = {
        "rank": rank,
        "world_size": dist.world_size(),
        "begin": rec.begin,
        "steps": rec.steps,
        "evals": rec.evals,
        "checkpoints": [[c.step, c.final] for c in rec.checkpoints],
        "final_checkpoint": str(result.final_checkpoint.path) if result.final_checkpoint else None,
        "steps_done": result.steps,
    }
    Path(f"{spec['out']}.rank{rank}.json").write_text(json.dumps(out), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1])
