"""bench/gpu_suite.py's ``--smoke``: the GPU suite's own code on a CPU with tiny shapes, so that it
cannot rot between GPU runs. One run of the suite (a child process, ~20 s on 2 cores) writes the
results file; the tests read it. The pure parts (ratios, targets, the LoRA FLOP count) are checked on
figures written here."""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaConfig

from bench import gpu_suite
from bench.model_flops import RowShape, decoder_matmul_weights, training_flops

ROOT = Path(__file__).resolve().parent.parent
BASE_METHODS = {"sft_lora": "tokens/s", "sft_full": "tokens/s", "dpo": "pairs/s", "grpo": "completions/s"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The results of one ``--smoke`` run, with its markdown next to them."""
    tmp = tmp_path_factory.mktemp("gpu-suite")
    env = {**os.environ, "TUNEHOUSE_BENCH_CACHE": str(tmp / "cache"), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "bench.gpu_suite", "--smoke", "--results-dir", str(tmp / "results")]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    name = f"gpu-{datetime.date.today().isoformat()}-cpu"
    results: dict[str, Any] = json.loads((tmp / "results" / f"{name}.json").read_text(encoding="utf-8"))
    results["_markdown"] = (tmp / "results" / f"{name}.md").read_text(encoding="utf-8")
    results["_stdout"] = done.stdout
    return results


def test_the_results_file_has_the_schema(smoke: dict[str, Any]) -> None:
    assert smoke["schema"] == gpu_suite.SCHEMA
    assert smoke["smoke"] is True
    assert smoke["machine"]["status"] == "ok" and smoke["machine"]["gpu"] is None
    assert {"torch", "transformers", "trl", "peft"} <= smoke["machine"]["versions"].keys()
    assert "12*L*d*t^2" in smoke["flop_formula"]
    assert set(smoke["levers"]) == set(gpu_suite.LEVERS) | set(gpu_suite.NOT_BUILT)
    assert all(b["status"] == "ok" for b in smoke["builds"])


def test_every_base_row_has_numbers(smoke: dict[str, Any]) -> None:
    base = [r for r in smoke["rows"] if r["lever"] == "base"]
    assert {(r["method"], r["impl"]) for r in base} == {(m, i) for m in BASE_METHODS for i in ("ours", "trl")}
    for row in base:
        assert row["status"] == "ok", row
        assert row["units"] == BASE_METHODS[row["method"]]
        assert row["rate"] > 0 and row["step_s"] > 0 and row["first_step_s"] > 0
        assert row["steps"] == gpu_suite.WORKLOADS[("smoke", row["method"])].steps
        assert math.isfinite(row["first_loss"])
        assert row["wrote_checkpoint"] is False  # ours is cancelled before its final checkpoint
        # a CPU has no device-memory peak: the field is there, null, with the reason
        assert row["peak_memory_gib"] is None and "CPU" in row["peak_memory_reason"]
        assert row["mfu"] is None and row["mfu_reason"]
        if row["method"] in gpu_suite.SFT_METHODS:
            assert row["tokens_per_s"] > 0 and row["tflops"] > 0


def test_levers_that_cannot_run_here_are_rows_with_a_reason(smoke: dict[str, Any]) -> None:
    levers = [r for r in smoke["rows"] if r["lever"] != "base"]
    assert {r["lever"] for r in levers} == set(gpu_suite.LEVERS) - {"base"}
    for row in levers:
        assert row["status"] in ("not installed", "skipped"), row
        assert row["reason"] in ("needs CUDA", f"not installed: {gpu_suite.LEVERS[row['lever']].package}")


def test_the_losses_agree_with_trl(smoke: dict[str, Any]) -> None:
    checks = smoke["correctness"]
    names = [c["check"] for c in checks]
    assert names[0].startswith("sft loss, one batch")
    assert {n.split(", ")[1].split(":")[0] for n in names[1:]} == {
        "smoke sft_lora",
        "smoke sft_full",
        "smoke dpo",
    }
    for check in checks:
        assert check["passed"] is True and check["abs_diff"] <= check["tolerance"], check


def test_the_table_is_printed_and_written(smoke: dict[str, Any]) -> None:
    head = "| " + " | ".join(gpu_suite.TABLE_HEAD) + " |"
    assert head in smoke["_stdout"] and head in smoke["_markdown"]
    assert "| smoke | dpo | base | pairs/s |" in smoke["_markdown"]
    assert all(t["met"] is None for t in smoke["targets"])  # no target is at the smoke model's size


def _ok(
    model: str, method: str, lever: str, impl: str, rate: float, peak: float, loss: float
) -> dict[str, Any]:
    return {
        "model": model,
        "method": method,
        "lever": lever,
        "impl": impl,
        "status": "ok",
        "rate": rate,
        "peak_memory_gib": peak,
        "first_loss": loss,
        "mfu": 0.45 if method == "sft_full" and impl == "ours" else None,
    }


def test_ratios_and_targets_from_rows() -> None:
    m = "qwen2.5-1.5b"
    rows = [
        _ok(m, "sft_full", "base", "ours", 130.0, 30.0, 12.0),
        _ok(m, "sft_full", "base", "trl", 100.0, 50.0, 12.001),
        _ok(m, "sft_lora", "base", "ours", 120.0, 40.0, 12.0),
        _ok(m, "sft_lora", "base", "trl", 100.0, 50.0, 12.0),
        _ok(m, "sft_lora", "varlen", "ours", 150.0, 35.0, 12.0),
    ]
    comparisons = gpu_suite.compare(rows)
    by_key = {(c["method"], c["lever"]): c for c in comparisons}
    assert by_key[("sft_full", "base")]["speed_ratio"] == pytest.approx(1.3)
    assert by_key[("sft_full", "base")]["memory_ratio"] == pytest.approx(0.6)
    assert by_key[("sft_full", "base")]["loss_delta"] == pytest.approx(0.001)
    # an ours-only lever: against TRL's base row, and against ours without it
    assert by_key[("sft_lora", "varlen")]["speed_ratio"] == pytest.approx(1.5)
    assert by_key[("sft_lora", "varlen")]["gain_over_base"] == pytest.approx(1.25)
    assert by_key[("sft_lora", "varlen")]["loss_delta"] is None  # packed: not the same batch

    met = {t["target"]: t["met"] for t in gpu_suite.targets(rows, comparisons)}
    assert met["full SFT speed, 1.5B"] is True  # 1.3 >= 1.2
    assert met["full SFT MFU, 1.5B"] is True
    assert met["SFT LoRA speed, 1.5B"] is False  # 1.2 < 1.3
    assert met["peak memory, every base row"] is False  # the LoRA row is 0.8x
    assert met["DPO speed, 1.5B"] is None and met["8B LoRA at 4k on 80 GB"] is None

    checks = gpu_suite.loss_checks(comparisons, rows)
    assert [c["passed"] for c in checks] == [True, True]  # Δ 1e-3 within 1e-3 x 12.001


def test_lora_flops_count_four_per_weight_and_token() -> None:
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
    )
    rows = [RowShape(tokens=10, targets=4)]
    body, head = decoder_matmul_weights(config) * 10, 300 * 48 * 4
    attention = 12 * 3 * 48 * 10**2
    assert training_flops(config, rows) == 6 * (body + head) + attention
    assert training_flops(config, rows, trained_weights=False) == 4 * (body + head) + attention


@pytest.mark.parametrize("key", sorted(gpu_suite.WORKLOADS), ids=lambda k: ":".join(k))
def test_every_workload_makes_its_rows(key: tuple[str, str]) -> None:
    """Each cell's rows are made from its size, for every method at once: the first GPU run's SFT sizes
    (answers of 1,000-1,800 words) asked the pairs for 1,000-900 words and no SFT cell ran. Smoke sizes
    alone never reached it."""
    from bench.trainers_vs_trl import make_rows

    size = gpu_suite.WORKLOADS[key]
    rows = make_rows(size)
    assert len(rows["sft"]) == len(rows["pairs"]) == len(rows["prompts"]) == size.n_rows
    low, high = size.completion_words
    for row in rows["sft"]:
        assert low <= len(row["completion"].split()) <= high
