"""The pre-flight memory estimate (``trainers.memory_model``) against the measured peak of SFT steps, on
SmolLM2-135M-Instruct (and the tiny model with ``--tiny``): a markdown table of estimate / measured.

    .venv/bin/python -m bench.memory_estimate            # SmolLM2, CPU, fp32
    .venv/bin/python -m bench.memory_estimate --tiny     # the tiny test model

The measured peak is the largest sum of live tensor storages during two steps
(``tests.trainers.peak_memory``: a dispatch mode counts every tensor; the CPU allocator keeps no peak and
RSS is too noisy); the estimate is given the micro-batch's rows, padded width and targets.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.trainers_vs_trl import smollm2_path
from tests.trainers.peak_memory import measure_sft_peak, synthetic_rows
from trainers.memory_model import ModelShape, TrainingShape, estimate_memory

# (LoRA, gradient checkpointing, rows, words per row, max_length)
CASES = [
    (True, False, 4, 300, 512),
    (False, False, 4, 300, 512),
    (True, True, 4, 300, 512),
    (False, True, 4, 300, 512),
    (True, False, 2, 800, 1024),
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny test model instead of SmolLM2")
    args = parser.parse_args()
    if args.tiny:
        from trainers.modeling.tiny_model import build_tiny_model

        path = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    else:
        path = smollm2_path()
    shape = ModelShape.from_config(json.loads((path / "config.json").read_text(encoding="utf-8")))
    print(
        "| model | weights | checkpointing | rows x width | estimate MiB | measured MiB "
        "| estimate / measured |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for lora, checkpointing, rows, words, max_length in CASES:
        measured = measure_sft_peak(
            path,
            synthetic_rows(rows, words),
            use_lora=lora,
            max_length=max_length,
            gradient_checkpointing=checkpointing,
            mixed_precision="no",
        )
        estimate = estimate_memory(
            shape,
            TrainingShape(
                lora=lora,
                micro_batch_rows=rows,
                row_width=measured.tokens // rows,
                micro_batch_targets=measured.targets,
                padded=measured.padded,
                gradient_checkpointing=checkpointing,
            ),
        )
        print(
            f"| {'tiny' if args.tiny else 'SmolLM2-135M'} | {'LoRA' if lora else 'full'} | "
            f"{'yes' if checkpointing else 'no'} | {rows} x {measured.tokens // rows} | "
            f"{estimate.total / 2**20:.1f} | {measured.peak_bytes / 2**20:.1f} | "
            f"{estimate.total / measured.peak_bytes:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
