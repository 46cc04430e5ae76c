"""Data-parallel training on CPU (gloo): 2 ranks launched by torch.distributed.run train like 1 process
with the same global batch, write one set of checkpoints, and a run whose rank was killed resumes on
another number of ranks.

Tolerance: the 2-rank step sums the same per-token losses and gradients as the 1-process step, in another
order (each rank sums its micro-batches, then gloo adds the two partial sums), so the curves agree to
float32 rounding, not bit for bit: 1e-5 relative (measured differences are ~1e-7; a wrong share of the
batch or a wrong denominator moves the loss by >1e-2).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.trainers.helpers import Recorder
from tests.trainers.test_dpo import separable_rows
from trainers.checkpoint import latest_checkpoint, resumable_checkpoints
from trainers.registry import METHODS, resolve

REL = 1e-5
KEYS = ("loss", "grad_norm", "learning_rate", "trained_tokens", "epoch")

# 18 rows of 2 = 9 micro-batches an epoch; a step takes 4 (2 per rank x 2 ranks, or 4 in one process),
# so each epoch ends with a step of one micro-batch: rank 1 has none there and must still take part.
SFT_RUN: dict[str, Any] = {
    "batch_size": 2,
    "n_epochs": 2,
    "use_lora": False,
    "learning_rate": 1e-3,
    "warmup_ratio": 0.2,
    "lr_scheduler": "cosine",
    "weight_decay": 0.01,
    "save_steps": 2,
    "seed": 11,
}


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def launch(
    tmp: Path, *, ranks: int, method: str, config: dict[str, Any], rows: str, **extra: Any
) -> tuple[subprocess.CompletedProcess[bytes], list[dict[str, Any]]]:
    """Run the trainer on ``ranks`` gloo processes through torch.distributed.run; each rank's report."""
    out = tmp / "report"
    spec = {"method": method, "config": config, "rows": rows, "out": str(out), **extra}
    (tmp / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    cmd += ["--max-restarts=0", "-m", "tests.trainers.dist_entry", str(tmp / "spec.json")]
    done = subprocess.run(cmd, capture_output=True, timeout=300)
    reports = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(tmp.glob("report.rank*.json"))]
    return done, reports


def in_process(
    method: str, config: dict[str, Any], rows: list[dict[str, Any]], valid: Any = None
) -> Recorder:
    rec = Recorder()
    m = METHODS[method]
    resolve(m.trainer)(resolve(m.config)(**config), rows, valid, rec)
    return rec


def assert_same_curve(
    ours: list[dict[str, float]], theirs: list[dict[str, float]], keys: tuple[str, ...]
) -> None:
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    for a, b in zip(ours, theirs, strict=True):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=REL, abs=1e-7), (a["step"], key, a[key], b[key])


@pytest.fixture(scope="module")
def sft_reference(
    tiny_model_path: Path, demo_rows: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Recorder, dict[str, Any]]:
    """One process, 4 micro-batches a step: the global batch of 2 ranks x 2 micro-batches."""
    out = tmp_path_factory.mktemp("sft-1rank")
    config = {**SFT_RUN, "gradient_accumulation_steps": 4, "model_path": str(tiny_model_path)}
    rec = in_process("supervised", {**config, "output_dir": str(out)}, demo_rows[:18], demo_rows[18:23])
    return rec, config


def test_two_rank_sft_matches_one_process(
    sft_reference: tuple[Recorder, dict[str, Any]], demo_rows: list[dict[str, Any]], tmp_path: Path
) -> None:
    reference, config = sft_reference
    rows = _write_rows(tmp_path / "train.jsonl", demo_rows[:18])
    valid = _write_rows(tmp_path / "valid.jsonl", demo_rows[18:23])
    two = {**config, "gradient_accumulation_steps": 2, "output_dir": str(tmp_path / "out")}
    done, reports = launch(tmp_path, ranks=2, method="supervised", config=two, rows=rows, valid_rows=valid)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    main, other = reports
    assert (main["rank"], main["world_size"], other["rank"]) == (0, 2, 1)
    assert main["begin"]["total_steps"] == reference.begin["total_steps"] == 6
    assert_same_curve(main["steps"], reference.steps, (*KEYS, "mean_token_accuracy"))
    assert_same_curve(main["evals"], reference.evals, ("valid_loss", "valid_mean_token_accuracy"))
    # rank 0 alone reports and writes: one set of checkpoints, the same as the 1-process run's
    assert (other["steps"], other["checkpoints"], other["final_checkpoint"]) == ([], [], None)
    assert (
        main["checkpoints"]
        == [[c.step, c.final] for c in reference.checkpoints]
        == [
            [2, False],
            [4, False],
            [6, True],
        ]
    )
    folders = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert folders == ["checkpoint-000002", "checkpoint-000004", "checkpoint-000006"]


def test_killed_rank_ends_the_run_and_it_resumes_on_one_process(
    sft_reference: tuple[Recorder, dict[str, Any]], demo_rows: list[dict[str, Any]], tmp_path: Path
) -> None:
    reference, config = sft_reference
    rows = _write_rows(tmp_path / "train.jsonl", demo_rows[:18])
    out = tmp_path / "out"
    two = {**config, "gradient_accumulation_steps": 2, "output_dir": str(out)}
    started = time.monotonic()
    done, reports = launch(
        tmp_path,
        ranks=2,
        method="supervised",
        config=two,
        rows=rows,
        timeout=30,
        kill={"rank": 1, "after_checkpoint": 2},
    )
    # rank 1 died: rank 0's next collective fails and the launcher ends the run, no rank left hanging
    assert done.returncode != 0 and reports == []
    assert time.monotonic() - started < 120
    assert [p.name for p in resumable_checkpoints(out)][-1] == "checkpoint-000002"
    ckpt = latest_checkpoint(out)
    assert ckpt is not None
    resumed_at = int(ckpt.name.removeprefix("checkpoint-"))

    # resume on a different number of ranks: 1 process, the same global batch
    one = {**config, "output_dir": str(tmp_path / "resumed"), "resume_from": str(ckpt)}
    rec = in_process("supervised", one, demo_rows[:18])
    assert rec.begin["total_steps"] == 6
    assert_same_curve(rec.steps, reference.steps[resumed_at:], KEYS)


# Every offline method other than SFT trains on preference pairs; KTO reads each pair as two unpaired rows
# and needs 2 of them per micro-batch, as its KL estimate pairs each prompt with another's completion.
PAIR_METHODS = ["dpo", "orpo", "cpo", "simpo", "kto", "reward_model"]


@pytest.mark.parametrize("method", PAIR_METHODS)
def test_two_rank_preference_methods_match_one_process(
    method: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    """Every step metric (the method's own included) as the 1-process run with the same global batch."""
    assert {m for m, d in METHODS.items() if d.data_parallel} == {"supervised", *PAIR_METHODS}
    pairs = separable_rows(10)  # 5 micro-batches of 2: the last step has one, on rank 0
    base = {
        "model_path": str(tiny_model_path),
        "batch_size": 2,
        "n_epochs": 1,
        "learning_rate": 5e-3,
        "seed": 5,
        "save_steps": 0,
    }
    reference = in_process(
        method, {**base, "gradient_accumulation_steps": 2, "output_dir": str(tmp_path / "one")}, pairs
    )
    rows = _write_rows(tmp_path / "pairs.jsonl", pairs)
    config = {**base, "gradient_accumulation_steps": 1, "output_dir": str(tmp_path / "two")}
    done, reports = launch(tmp_path, ranks=2, method=method, config=config, rows=rows)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    main = reports[0]
    steps = len(reference.steps)
    assert len(main["steps"]) == steps >= 3
    measured = set(reference.steps[0]) - {"step", "tokens_per_second"}
    assert set(main["steps"][0]) - {"step", "tokens_per_second"} == measured
    assert_same_curve(main["steps"], reference.steps, tuple(sorted(measured)))
    assert main["checkpoints"] == [[steps, True]]
