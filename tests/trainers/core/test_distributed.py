"""Data-parallel training on CPU (gloo): 2 ranks launched by torch.distributed.run train like 1 process
with the same global batch, write one set of checkpoints, and a run whose rank was killed resumes on
another number of ranks.

Tolerance: the 2-rank step sums the same per-token losses and gradients as the 1-process step, in another
order (each rank sums its micro-batches, then gloo adds the two partial sums), so the curves agree to
float32 rounding, not bit for bit: 1e-5 relative (measured differences are ~1e-7; a wrong share of the
batch or a wrong denominator moves the loss by >1e-2). FSDP (sharded) runs: 1e-4, as they compute the
logits whole where one process chunks the LM head (``REL_SHARDED``); a gradient that is averaged over the
ranks instead of summed moves the loss by >1e-2 there too.

The online methods on 2 ranks sample other completions than one process does; their tests check what
must still hold: the prompts a step covers, its metrics over both ranks, and an exact resume. Sampling
greedily (top-p keeping one token), 2 ranks draw one process's completions, and PPO's steps equal its.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainers.helpers import Recorder
from trainers.core.checkpoint import latest_checkpoint, resumable_checkpoints
from trainers.registry import METHODS, resolve
from trainers.rewards.graders import build_grader
from trainers.rewards.reward_set import RewardSet

REL = 1e-5
# FSDP runs the whole model to its logits where the 1-process run applies the LM head chunk by chunk
# (trainers/core/sharding.py): the log-softmax is rounded differently, ~1e-5 relative after a few steps
REL_SHARDED = 1e-4
TOLERANCE = {"ddp": REL, "fsdp": REL_SHARDED}
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
    done, reports = launch_together(
        tmp, ranks=ranks, runs={"run": {"method": method, "config": config, "rows": rows, **extra}}
    )
    return done, reports["run"]


def launch_together(
    tmp: Path, *, ranks: int, runs: dict[str, dict[str, Any]]
) -> tuple[subprocess.CompletedProcess[bytes], dict[str, list[dict[str, Any]]]]:
    """``launch`` for several runs (each ``launch``'s keywords but ``ranks``, by a name), one after
    another in one launch: each rank's report of each run by its name. A run that fails ends the
    launch: its error is in the process's stderr, and the runs after it have no reports."""
    specs = []
    for name, run in runs.items():
        (tmp / name).mkdir(parents=True, exist_ok=True)
        specs.append({**run, "out": str(tmp / name / "report")})
    (tmp / "spec.json").write_text(json.dumps({"runs": specs}), encoding="utf-8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    cmd += ["--max-restarts=0", "-m", "tests.trainers.dist_entry", str(tmp / "spec.json")]
    done = subprocess.run(cmd, capture_output=True, timeout=300 * len(runs))
    reports = {
        name: [json.loads(p.read_text(encoding="utf-8")) for p in sorted((tmp / name).glob("report.rank*"))]
        for name in runs
    }
    return done, reports


def in_process(
    method: str,
    config: dict[str, Any],
    rows: list[dict[str, Any]],
    valid: Any = None,
    graders: list[dict[str, Any]] | None = None,
) -> Recorder:
    """One process; ``graders`` (grader specs) are an online method's rewards, as ``launch`` takes them."""
    rec = Recorder()
    m = METHODS[method]
    rewards = {"rewards": RewardSet.of([build_grader(g) for g in graders])} if graders else {}
    resolve(m.trainer)(resolve(m.config)(**config), rows, valid, rec, **rewards)
    return rec


def assert_same_curve(
    ours: list[dict[str, float]],
    theirs: list[dict[str, float]],
    keys: tuple[str, ...],
    rel: float = REL,
    abs_tol: float = 1e-7,
) -> None:
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    for a, b in zip(ours, theirs, strict=True):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=rel, abs=abs_tol), (a["step"], key, a[key], b[key])


@pytest.fixture(scope="module")
def sft_reference(
    tiny_model_path: Path, demo_rows: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Recorder, dict[str, Any]]:
    """One process, 4 micro-batches a step: the global batch of 2 ranks x 2 micro-batches."""
    out = tmp_path_factory.mktemp("sft-1rank")
    config = {**SFT_RUN, "gradient_accumulation_steps": 4, "model_path": str(tiny_model_path)}
    rec = in_process("supervised", {**config, "output_dir": str(out)}, demo_rows[:18], demo_rows[18:23])
    return rec, config


Launched = tuple[subprocess.CompletedProcess[bytes], dict[str, list[dict[str, Any]]]]


@pytest.fixture(scope="module")
def two_rank_sft(
    sft_reference: tuple[Recorder, dict[str, Any]],
    demo_rows: list[dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, Launched]:
    """The 2-rank SFT runs of the tests below in one launch (``launch_together``): DDP and FSDP, each
    with a validation set, and FSDP resumed from the 1-process run's checkpoint of step 2."""
    reference, config = sft_reference
    tmp = tmp_path_factory.mktemp("two-rank-sft")
    rows = _write_rows(tmp / "train.jsonl", demo_rows[:18])
    valid = _write_rows(tmp / "valid.jsonl", demo_rows[18:23])
    two = {**config, "gradient_accumulation_steps": 2}
    runs: dict[str, dict[str, Any]] = {
        strategy: {
            "method": "supervised",
            "config": {**two, "output_dir": str(tmp / strategy / "out")},
            "rows": rows,
            "valid_rows": valid,
            "strategy": strategy,
        }
        for strategy in ("ddp", "fsdp")
    }
    start = reference.checkpoints[0].path
    assert reference.checkpoints[0].step == 2 and (start / "state").is_dir()
    runs["fsdp-resumed"] = {
        "method": "supervised",
        "config": {**two, "output_dir": str(tmp / "fsdp-resumed" / "out"), "resume_from": str(start)},
        "rows": rows,
        "strategy": "fsdp",
    }
    return tmp, launch_together(tmp, ranks=2, runs=runs)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_rank_sft_matches_one_process(
    strategy: str,
    sft_reference: tuple[Recorder, dict[str, Any]],
    two_rank_sft: tuple[Path, Launched],
) -> None:
    """DDP and FSDP alike; FSDP's rank 1 runs a stand-in micro-batch at each epoch's end (it has none)
    and a stand-in validation chunk (5 rows: 3 chunks of 2), or the ranks' weight gathers would not pair."""
    reference, _ = sft_reference
    tmp, (done, runs) = two_rank_sft
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    main, other = runs[strategy]
    assert (main["rank"], main["world_size"], other["rank"]) == (0, 2, 1)
    assert main["begin"]["total_steps"] == reference.begin["total_steps"] == 6
    rel = TOLERANCE[strategy]
    assert_same_curve(main["steps"], reference.steps, (*KEYS, "mean_token_accuracy"), rel)
    assert_same_curve(main["evals"], reference.evals, ("valid_loss", "valid_mean_token_accuracy"), rel)
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
    folders = sorted(p.name for p in (tmp / strategy / "out").iterdir())
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


def test_an_fsdp_checkpoint_resumes_on_one_process_and_a_one_process_one_on_fsdp(
    sft_reference: tuple[Recorder, dict[str, Any]],
    two_rank_sft: tuple[Path, Launched],
    demo_rows: list[dict[str, Any]],
    tmp_path: Path,
) -> None:
    """FSDP writes the whole weights and optimizer state, as one process does: either resumes the
    other's checkpoint and repeats the uninterrupted run's steps."""
    reference, config = sft_reference
    tmp, (done, runs) = two_rank_sft
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    ckpt = tmp / "fsdp" / "out" / "checkpoint-000002"
    one = {**config, "output_dir": str(tmp_path / "one"), "resume_from": str(ckpt)}
    rec = in_process("supervised", one, demo_rows[:18])
    assert_same_curve(rec.steps, reference.steps[2:], KEYS, REL_SHARDED)
    # and the 1-process run's checkpoint of step 2, resumed sharded on 2 ranks (in the same launch)
    assert_same_curve(runs["fsdp-resumed"][0]["steps"], reference.steps[2:], KEYS, REL_SHARDED)


# Every offline method other than SFT trains on preference pairs; KTO reads each pair as two unpaired rows
# and needs 2 of them per micro-batch, as its KL estimate pairs each prompt with another's completion.
def test_step_statistics_are_taken_over_every_rank(tmp_path: Path) -> None:
    """Ranks holding unequal shares of a batch get one process's batch-wide reward scale, advantage
    whitening and sums (a rank's own share's would differ: the shares have different statistics)."""
    from tests.trainers.dist_stats_entry import ROWS, share
    from trainers.families.rollout import rollout_seed
    from trainers.losses.advantages import group_advantages, masked_whiten

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["--max-restarts=0", "-m", "tests.trainers.dist_stats_entry", str(tmp_path / "stats")]
    done = subprocess.run(cmd, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    ranks = [torch.load(tmp_path / f"stats.rank{r}.pt") for r in range(2)]

    shares = [share(r) for r in range(2)]
    rewards = torch.cat([s[0] for s in shares])
    width = max(s[1].size(1) for s in shares)  # one process pads the whole batch to one width
    padded = [torch.nn.functional.pad(t, (0, width - t.size(1))) for s in shares for t in s[1:]]
    advantages, mask = torch.cat(padded[0::2]), torch.cat(padded[1::2])
    batch_scaled = group_advantages(rewards, 2, "batch")
    whitened = masked_whiten(advantages, mask)
    starts = [0, ROWS[0]]
    for r, got in enumerate(ranks):
        rows = slice(starts[r], starts[r] + ROWS[r])
        assert got["mine"] == (rows.start, rows.stop)
        assert torch.equal(got["gathered"].nan_to_num(-9), rewards.nan_to_num(-9))
        assert torch.allclose(got["batch_scaled"], batch_scaled[rows], atol=1e-6)
        assert not torch.allclose(got["batch_scaled"], group_advantages(shares[r][0], 2, "batch"))
        own_width = shares[r][1].size(1)
        assert torch.allclose(got["whitened"], whitened[rows, :own_width], atol=1e-5)
        assert torch.allclose(got["summed"], mask.sum())
    # the ranks share the loop's RNG, but not their sampling seeds: rank 0 draws one process's
    torch.manual_seed(0)
    assert ranks[0]["sampling_seed"] == rollout_seed() != ranks[1]["sampling_seed"]


# 10 prompts, 2 a micro-batch: 5 micro-batches an epoch, 2 a step (2 ranks, or 2 accumulated in one
# process): the last step has one, on rank 0, and rank 1 samples the epoch's first micro-batch instead.
# Reward "v" depends on the prompt only: its step mean is the same however the completions came out, so
# it shows which prompts a step covered. Reward "e" depends on the completion: it gives the run a signal.
