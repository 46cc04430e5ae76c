"""Multi-LoRA batching against interleaving on this host (bench/multi_lora_batching.py): four SFT jobs'
micro-batches on SmolLM2-135M, in fp32 (a CPU's default) and under bf16 autocast.

    make bench TRAINER_BENCH=--skip ARGS="-k multi_lora -s"
"""

from __future__ import annotations

import pytest
import torch

from bench.multi_lora_batching import measure
from bench.trainers_vs_trl import smollm2_path


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("width", [128, 256])
def test_batched_against_interleaved(precision: str, width: int) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = measure(smollm2_path(), device=device, precision=precision, width=width)
    print(
        f"\n{result['jobs']} jobs x {result['rows']} rows x {width} tokens, {precision} on {device}: "
        f"interleaved {result['interleaved_s']} s, "
        f"batched (lower bound) {result['batched_lower_bound_s']} s, "
        f"batched / interleaved = {result['batched_over_interleaved']}"
    )
