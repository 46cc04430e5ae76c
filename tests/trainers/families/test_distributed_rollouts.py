"""The online RL methods on 2 CPU ranks (gloo): a step covers the prompts one process's step does, its
metrics are over both ranks, greedy PPO steps equal one process's and a resume is exact (the launchers
of ``tests/trainers/core/test_distributed.py``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.trainers.core.test_distributed import (
    TOLERANCE,
    Launched,
    _write_rows,
    assert_same_curve,
    in_process,
    launch_together,
)

ONLINE_ROWS = [{"prompt": f"Question {i}:", "value": "yes" if i % 3 else "no"} for i in range(10)]
ONLINE_GRADERS = [
    {"type": "string_check", "name": "v", "operation": "eq", "input": "{{item.value}}", "reference": "yes"},
    {
        "type": "string_check",
        "name": "e",
        "operation": "like",
        "input": "{{sample.output_text}}",
        "reference": "e",
    },
]
ONLINE_RUNS: dict[str, dict[str, Any]] = {
    "grpo": {"num_generations": 2, "scale_rewards": "batch", "beta": 0.1},
    "ppo": {"num_ppo_epochs": 1, "num_mini_batches": 1, "whiten_advantages": True},
    "rloo": {"num_generations": 2, "normalize_advantages": True},
    "online_dpo": {},
}


def _online_base(tiny_model_path: Path, method: str) -> dict[str, Any]:
    return {
        "model_path": str(tiny_model_path),
        "batch_size": 2,
        "n_epochs": 1,
        "max_completion_length": 4,
        "learning_rate": 1e-3,
        "seed": 3,
        "save_steps": 0,
        **ONLINE_RUNS[method],
    }


STRATEGIES = ["ddp", "fsdp"]
VALID_ROWS = ONLINE_ROWS[:3]  # sampled and graded once, at the end (FSDP: with the weights whole)
# Nucleus sampling that keeps the top token alone: greedy decoding, whatever the seed. Then 2 ranks
# sample one process's completions, and PPO's advantage whitening, taken over the whole step, must make
# their steps one process's. (GRPO, RLOO and online DPO learn nothing from greedy samples: a prompt's
# completions are all alike, so their advantages are 0; their step statistics are checked below.)
GREEDY = {"top_p": 1e-9}
# PPO whose checkpoint of step 3 lies between the 2 optimizer steps of its second rollout
RESUMABLE_PPO = {
    "num_ppo_epochs": 2,
    "gradient_accumulation_steps": 1,
    "save_steps": 1,
    "keep_checkpoints": 10,
}
RESUMED_FROM = "checkpoint-000003"
PPO_KEYS = ("loss", "grad_norm", "policy_loss", "value_loss", "rewards/e/mean", "completions/mean_length")


@pytest.fixture(scope="module")
def two_rank_runs(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Launched:
    """The 2-rank runs of the two tests below, every method and strategy, in one launch
    (``launch_together``)."""
    tmp = tmp_path_factory.mktemp("two-rank-rollouts")
    rows = _write_rows(tmp / "prompts.jsonl", ONLINE_ROWS)
    valid = _write_rows(tmp / "valid.jsonl", VALID_ROWS)
    runs: dict[str, dict[str, Any]] = {}
    for strategy in STRATEGIES:
        common = {"rows": rows, "graders": ONLINE_GRADERS, "strategy": strategy}
        for method in sorted(ONLINE_RUNS):
            name = f"{method}-{strategy}"
            config = {**_online_base(tiny_model_path, method), "gradient_accumulation_steps": 1}
            config["output_dir"] = str(tmp / name / "out")
            runs[name] = {"method": method, "config": config, "valid_rows": valid, **common}
        name = f"greedy-ppo-{strategy}"
        config = {**_online_base(tiny_model_path, "ppo"), **GREEDY, "gradient_accumulation_steps": 1}
        runs[name] = {"method": "ppo", "config": {**config, "output_dir": str(tmp / name / "out")}, **common}
        # PPO checkpointed at every step, then resumed from the step in the middle of its second
        # rollout: the runs of a launch go one after another, so that checkpoint is on disk by then
        resumable = {**_online_base(tiny_model_path, "ppo"), **RESUMABLE_PPO}
        whole = tmp / f"ppo-whole-{strategy}" / "out"
        runs[f"ppo-whole-{strategy}"] = {
            "method": "ppo",
            "config": {**resumable, "output_dir": str(whole)},
            **common,
        }
        runs[f"ppo-resumed-{strategy}"] = {
            "method": "ppo",
            "config": {
                **resumable,
                "output_dir": str(tmp / f"ppo-resumed-{strategy}" / "out"),
                "resume_from": str(whole / RESUMED_FROM),
            },
            **common,
        }
    return launch_together(tmp, ranks=2, runs=runs)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("method", sorted(ONLINE_RUNS))
def test_two_rank_online_methods_cover_the_one_process_steps(
    method: str, strategy: str, tiny_model_path: Path, tmp_path: Path, two_rank_runs: Launched
) -> None:
    """Each rank samples and trains its share of a step's prompts; the step's metrics are over both
    ranks' completions. Sampling differs from one process's (each rank draws its own), so the loss is
    not compared: the prompt-only reward's mean shows that a step covers the same prompts."""
    base = _online_base(tiny_model_path, method)
    one = {**base, "gradient_accumulation_steps": 2, "output_dir": str(tmp_path / "one")}
    reference = in_process(method, one, ONLINE_ROWS, VALID_ROWS, ONLINE_GRADERS)
    done, reports = two_rank_runs
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    main, other = reports[f"{method}-{strategy}"]
    assert len(main["steps"]) == len(reference.steps) == 3
    assert set(main["steps"][0]) == set(reference.steps[0])
    # steps 1 and 2 hold the same 4 prompts on 2 ranks as in one process
    for ours, theirs in zip(main["steps"][:2], reference.steps[:2], strict=True):
        assert ours["rewards/v/mean"] == pytest.approx(theirs["rewards/v/mean"], abs=1e-6)
    # the last step: rank 0's micro-batch 4 and, on rank 1, micro-batch 0 again; one process: 4 alone
    assert main["steps"][2]["rewards/v/mean"] != pytest.approx(reference.steps[2]["rewards/v/mean"])
    assert [e["step"] for e in main["evals"]] == [e["step"] for e in reference.evals] == [3]
    # the prompt-only reward of the validation prompts: the same whatever was sampled
    assert main["evals"][0]["valid_reward/v"] == reference.evals[0]["valid_reward/v"]
    assert all(math.isfinite(row["loss"]) for row in main["steps"])
    assert (other["steps"], other["checkpoints"]) == ([], [])
    assert main["checkpoints"] == [[3, True]]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_rank_greedy_ppo_steps_equal_one_process(
    strategy: str, tiny_model_path: Path, tmp_path: Path, two_rank_runs: Launched
) -> None:
    base = {**_online_base(tiny_model_path, "ppo"), **GREEDY}
    one = {**base, "gradient_accumulation_steps": 2, "output_dir": str(tmp_path / "one")}
    reference = in_process("ppo", one, ONLINE_ROWS, None, ONLINE_GRADERS)
    assert all(row["grad_norm"] > 0 for row in reference.steps[:2])  # it learns from these samples
    done, reports = two_rank_runs
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    # steps 1 and 2 cover the same prompts on both sides (the last step does not, see above)
    # PPO's policy loss here is a mean of whitened advantages (zero-sum) times ratios within ~1e-6 of 1:
    # what is left is float32 rounding (~1e-6, 7.4e-7 against 9.3e-7), which any change in the order of
    # a sum moves; the other keys carry the comparison
    assert_same_curve(
        reports[f"greedy-ppo-{strategy}"][0]["steps"][:2],
        reference.steps[:2],
        PPO_KEYS,
        TOLERANCE[strategy],
        abs_tol=2e-6,
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_rank_ppo_resumes_mid_rollout_as_if_uninterrupted(strategy: str, two_rank_runs: Launched) -> None:
    """A checkpoint taken between the optimizer steps of one rollout holds each rank's share of it:
    2 ranks resumed from it repeat the uninterrupted 2-rank run's steps exactly (FSDP: the value head,
    sharded too, comes back whole from the checkpoint)."""
    done, reports = two_rank_runs
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    uninterrupted = reports[f"ppo-whole-{strategy}"][0]["steps"]
    assert len(uninterrupted) == 6
    assert_same_curve(reports[f"ppo-resumed-{strategy}"][0]["steps"], uninterrupted[3:], PPO_KEYS)
