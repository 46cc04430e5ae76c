"""The pre-flight estimate's peak memory (``trainers.memory_model``) against the CUDA peaks a GPU suite run
measured (``torch.cuda.max_memory_allocated`` of each of our cells, ``bench/gpu_suite.py``).

    .venv/bin/python -m bench.estimate_vs_gpu bench/results/gpu-2026-11-28-h200-run1.json \
        bench/results/gpu-2026-11-28-h200-run2.json

Needs no GPU: for each of our SFT and DPO cells with a measured peak, it makes the cell's rows again
(``make_rows`` of its workload, the suite's seed), reads them as the estimate's worker does
(``trainers.data.file_stats``: the largest micro-batch's rows, padded width and trained tokens), and asks
the memory model what the API's estimate asks it for that job on a CUDA worker (bf16 autocast, the
suite's settings: no gradient checkpointing, LoRA r 8 on every projection). It prints a markdown table
of estimate / measured; the target is within ±15%.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.gpu_suite import MODELS, WORKLOADS
from bench.trainers_vs_trl import make_rows, model_path
from trainers.memory_model import ModelShape, TrainingShape, estimate_memory, precision_bytes
from trainers.registry import get_method

TOLERANCE = 0.15
# our cells the estimate describes: the suite's method name -> the API's method type and whether LoRA
ESTIMATED = {"sft_lora": ("supervised", True), "sft_full": ("supervised", False), "dpo": ("dpo", True)}


def predicted_bytes(model: str, method: str) -> tuple[int, tuple[int, int, int]]:
    """The estimate's peak for the cell, and the micro-batch (rows, width, targets) it was given."""
    from transformers import AutoTokenizer

    from trainers.data.file_stats import pair_file_stats, sft_file_stats

    size = WORKLOADS[(model, method)]
    rows = make_rows(size)
    tokenizer = AutoTokenizer.from_pretrained(model_path("tiny"))
    tokenizer.model_max_length = 8192  # as the suite's models say (bench/gpu_suite.build_model)
    api_method, lora = ESTIMATED[method]
    if api_method == "supervised":
        stats = sft_file_stats(rows["sft"], tokenizer, max_length=size.max_length, batch_size=size.batch_size)
    else:
        stats = pair_file_stats(
            rows["pairs"],
            tokenizer,
            max_length=size.max_length,
            max_prompt_length=None,
            batch_size=size.batch_size,
        )
    batch = stats.largest_micro_batch()
    compute, lora_base = precision_bytes("bf16", "cuda")
    shape = TrainingShape(
        lora=lora,
        weight_bytes=lora_base,
        compute_bytes=compute,
        micro_batch_rows=batch[0],
        row_width=batch[1],
        micro_batch_targets=batch[2],
        reference=get_method(api_method).uses_reference({"lora": lora}),
        varlen_attention=True,  # the API's rule: CUDA in half precision
        padded=batch[0] > 1,
        device="cuda",
    )
    return estimate_memory(ModelShape.from_config(MODELS[model]), shape).total, batch


def compare(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for result in results:
        for row in result["rows"]:
            if (
                row.get("kind") != "cell"
                or row.get("impl") != "ours"
                or row.get("lever") != "base"
                or row.get("status") != "ok"
                or row.get("method") not in ESTIMATED
                or row.get("peak_memory_gib") is None
            ):
                continue
            predicted, batch = predicted_bytes(row["model"], row["method"])
            measured = row["peak_memory_gib"] * 2**30
            out.append(
                {
                    "model": row["model"],
                    "method": row["method"],
                    "micro_batch": batch,
                    "estimate_gib": predicted / 2**30,
                    "measured_gib": row["peak_memory_gib"],
                    "ratio": predicted / measured,
                }
            )
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | method | micro-batch (rows × width, targets) | estimate GiB | measured GiB | "
        "estimate / measured |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        n, width, targets = r["micro_batch"]
        within = "" if abs(r["ratio"] - 1) <= TOLERANCE else " (outside ±15%)"
        lines.append(
            f"| {r['model']} | {r['method']} | {n} × {width}, {targets} | {r['estimate_gib']:.1f} | "
            f"{r['measured_gib']:.1f} | {r['ratio']:.2f}{within} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", nargs="+", type=Path, help="GPU suite results files (JSON)")
    args = parser.parse_args(argv)
    results = [json.loads(path.read_text(encoding="utf-8")) for path in args.results]
    print(table(compare(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
