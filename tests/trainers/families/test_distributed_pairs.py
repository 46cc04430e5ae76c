"""The preference methods on 2 CPU ranks (gloo) train like 1 process with the same global batch (the
tolerances of ``tests/trainers/core/test_distributed.py``, whose launchers these tests use). The 2-rank
runs of all of them go in one launch (``launch_together``): a dozen launches cost ~1 minute of imports."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.trainers.core.test_distributed import (
    TOLERANCE,
    _write_rows,
    assert_same_curve,
    in_process,
    launch_together,
)
from tests.trainers.families.test_distributed_rollouts import ONLINE_RUNS
from tests.trainers.methods.test_dpo import separable_rows
from trainers.registry import METHODS

PAIR_METHODS = ["dpo", "orpo", "cpo", "simpo", "kto", "reward_model"]


STRATEGIES = ["ddp", "fsdp"]


def _base(tiny_model_path: Path) -> dict[str, Any]:
    return {
        "model_path": str(tiny_model_path),
        "batch_size": 2,
        "n_epochs": 1,
        "learning_rate": 5e-3,
        "seed": 5,
        "save_steps": 0,
    }


@pytest.fixture(scope="module")
def two_rank_runs(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[subprocess.CompletedProcess[bytes], dict[str, list[dict[str, Any]]]]:
    """Every method and strategy below on 2 ranks, in one launch (``launch_together``)."""
    tmp = tmp_path_factory.mktemp("two-rank-pairs")
    rows = _write_rows(tmp / "pairs.jsonl", separable_rows(10))
    config = {**_base(tiny_model_path), "gradient_accumulation_steps": 1}
    runs = {
        f"{method}-{strategy}": {
            "method": method,
            "config": {**config, "output_dir": str(tmp / f"{method}-{strategy}" / "out")},
            "rows": rows,
            "strategy": strategy,
        }
        for method in PAIR_METHODS
        for strategy in STRATEGIES
    }
    return launch_together(tmp, ranks=2, runs=runs)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("method", PAIR_METHODS)
def test_two_rank_preference_methods_match_one_process(
    method: str,
    strategy: str,
    tiny_model_path: Path,
    tmp_path: Path,
    two_rank_runs: tuple[subprocess.CompletedProcess[bytes], dict[str, list[dict[str, Any]]]],
) -> None:
    """Every step metric (the method's own included) as the 1-process run with the same global batch;
    LoRA (the default) sharded with its frozen base under FSDP, and the reward model's score head."""
    # every offline method is here: with SFT, the rest are online (their own test below; "reinforcement"
    # is GRPO under OpenAI's name)
    offline = {m for m, d in METHODS.items() if not d.grader}
    assert offline == {"supervised", *PAIR_METHODS}
    assert set(METHODS) == offline | set(ONLINE_RUNS) | {"reinforcement"}
    pairs = separable_rows(10)  # 5 micro-batches of 2: the last step has one, on rank 0
    one = {**_base(tiny_model_path), "gradient_accumulation_steps": 2, "output_dir": str(tmp_path / "one")}
    reference = in_process(method, one, pairs)
    done, reports = two_rank_runs
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    main = reports[f"{method}-{strategy}"][0]
    steps = len(reference.steps)
    assert len(main["steps"]) == steps >= 3
    measured = set(reference.steps[0]) - {"step", "tokens_per_second"}
    assert set(main["steps"][0]) - {"step", "tokens_per_second"} == measured
    assert_same_curve(main["steps"], reference.steps, tuple(sorted(measured)), TOLERANCE[strategy])
    assert main["checkpoints"] == [[steps, True]]
    # the exported model (LoRA merged into the base; FSDP: from the weights gathered whole)
    ours = load_file(Path(main["final_checkpoint"]) / "model" / "model.safetensors")
    theirs = load_file(reference.checkpoints[-1].path / "model" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name, weight in theirs.items():
        assert torch.allclose(ours[name], weight, rtol=0, atol=1e-5), name
