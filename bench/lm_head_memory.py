"""One SFT step's peak memory and time with the LM head applied in chunks (``losses.linear_cross_entropy``)
or by the model on every target position at once (``logits_to_keep``), on SmolLM2-135M-Instruct.

    .venv/bin/python -m bench.lm_head_memory                  # LoRA, 8 rows of up to 512 tokens
    .venv/bin/python -m bench.lm_head_memory --full           # full fine-tuning

Each mode runs in its own child process (peak RSS is the child's ``ru_maxrss``): the same seeded batch,
3 forward + backward passes of ``trainers.methods.sft.sft_loss``; it prints the loss (the two must agree), the
peak RSS and the median time of the passes after the first.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time

from bench.trainers_vs_trl import ROOT, smollm2_path
from trainers.families.entry import load_model_to_train

MODES = ("whole_model", "chunked")


def child(mode: str, full: bool) -> None:
    import torch

    from trainers.data.collate import pad_batch
    from trainers.data.sft import tokenize_sft_rows
    from trainers.methods.sft import SFTConfig, sft_loss
    from trainers.modeling import loading as modeling
    from trainers.modeling.loading import load_tokenizer
    from trainers.modeling.tiny_model import CORPUS_PATH

    if mode == "whole_model":
        modeling.PLAIN_HEAD_MODELS = frozenset()
    path = str(smollm2_path())
    torch.manual_seed(0)
    config = SFTConfig(path, "/nonexistent", use_lora=not full, max_length=512)
    tokenizer = load_tokenizer(path)
    rng, words = random.Random(0), CORPUS_PATH.read_text(encoding="utf-8").split()

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

    rows = [{"prompt": text(20, 80), "completion": " " + text(150, 350)} for _ in range(8)]
    batch = pad_batch(
        list(tokenize_sft_rows(rows, tokenizer, max_length=512)), pad_token_id=tokenizer.pad_token_id
    )
    model = load_model_to_train(config, torch.device("cpu"))
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        out = sft_loss(model, batch)
        (out.loss / batch.n_targets).backward()  # type: ignore[no-untyped-call]
        seconds.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    print(
        json.dumps(
            {
                "loss": out.loss.item() / batch.n_targets,
                "targets": batch.n_targets,
                "shape": list(batch.input_ids.shape),
                "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "step_s": statistics.median(seconds[1:]),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.full)
        return
    smollm2_path()  # made once, outside the measured children
    results = {}
    for mode in MODES:
        command = [
            sys.executable,
            "-m",
            "bench.lm_head_memory",
            "--child",
            mode,
            *(["--full"] if args.full else []),
        ]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    whole, chunked = results["whole_model"], results["chunked"]
    print(f"batch {whole['shape']}, {whole['targets']} targets, {'full' if args.full else 'LoRA'}")
    print("| head | loss | peak RSS MiB | s per step |")
    print("| --- | --- | --- | --- |")
    for mode in MODES:
        r = results[mode]
        print(f"| {mode} | {r['loss']:.6f} | {r['peak_mib']:.0f} | {r['step_s']:.1f} |")
    print(
        f"chunked / whole model: memory {chunked['peak_mib'] / whole['peak_mib']:.2f}×, "
        f"time {chunked['step_s'] / whole['step_s']:.2f}×"
    )


if __name__ == "__main__":
    main()
