"""Peak memory of an SFT (or GRPO) run as the training file grows: the data is read and tokenized to
disk, not held in RAM (issue 9 item 3).

    .venv/bin/python -m bench.data_memory                        # 1, 50 and 200 MB
    .venv/bin/python -m bench.data_memory --sizes-mb 1,50,500    # the issue's range (tokenizing 500 MB
                                                                 # takes ~20 min on 2 cores)
    .venv/bin/python -m bench.data_memory --method grpo          # a prompt file: RL rows with a column

``--method grpo`` writes ``{"prompt": ..., "answer": ...}`` rows instead and runs one GRPO step (2
prompts x 2 completions of 4 tokens, a ``string_check`` grader on the column); ``in RAM`` keeps its
tokenized prompts as a list, as ``trainers.families.rollout.tokenize_rl_rows`` did before it wrote them to
disk.

For each size it writes a JSONL file of ``{"text": ...}`` rows (seeded, lengths varied, ~1 KB a row)
and runs the tiny model's SFT trainer on it for 2 steps of 8 rows in a fresh child process, twice:

- ``on disk`` (what the worker does): rows read one at a time from the file (``trainers.data.jsonl_rows``),
  tokenized examples spilled to memory-mapped files (``trainers.data.example_store``);
- ``in RAM`` (before): every row parsed into a list first, the tokenized examples kept as Python lists
  (the store materialised with ``list()``), as the worker and trainers did until this change.

It prints each child's peak RSS (``ru_maxrss``) and wall time, and the ratio on disk / in RAM. The
model is the tiny one on purpose: its weights are a few MB, so what grows is the data's footprint.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainers.methods.sft import SFTConfig

ROOT = Path(__file__).resolve().parent.parent
MODES = ("on_disk", "in_ram")
WORDS = "the model learns from every row of the file one token at a time while memory stays flat"


def write_rows(path: Path, size_mb: float, seed: int = 0, *, method: str = "sft") -> int:
    """A JSONL file of about ``size_mb`` MB of text rows (RL prompt rows for ``grpo``); returns the row
    count."""
    rng = random.Random(seed)
    target, written, n = int(size_mb * 1024 * 1024), 0, 0
    with path.open("w", encoding="utf-8") as fh:
        while written < target:
            text = " ".join(rng.choice(WORDS.split()) for _ in range(rng.randint(60, 260)))
            row = {"text": text} if method == "sft" else {"prompt": text, "answer": rng.choice(WORDS.split())}
            line = json.dumps(row) + "\n"
            fh.write(line)
            written, n = written + len(line), n + 1
    return n


def child(mode: str, data: Path, model: Path, out: Path, method: str) -> None:
    """One run; prints a JSON line with the peak RSS in MiB and the seconds taken."""
    import trainers.methods.sft
    from trainers.data.jsonl_rows import JsonlRows
    from trainers.data.sft import tokenize_sft_rows
    from trainers.methods.sft import train_sft

    start = time.perf_counter()
    rows = JsonlRows(data, param="training_file")
    if method == "grpo":
        _grpo(mode, rows, model, out)
    elif mode == "in_ram":
        rows_in_ram = list(rows)
        # the tokenized examples as the Python lists the trainers kept before the store
        trainers.methods.sft.tokenize_sft_rows = lambda *a, **k: list(tokenize_sft_rows(*a, **k))  # type: ignore[attr-defined,assignment]
        train_sft(_config(model, out), rows_in_ram)
    else:
        train_sft(_config(model, out), rows)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_mib": peak_mib, "seconds": time.perf_counter() - start}))


def _grpo(mode: str, rows: Sequence[dict[str, Any]], model: Path, out: Path) -> None:
    import trainers.families.rl
    from trainers.families.rollout import tokenize_rl_rows
    from trainers.methods.grpo import GRPOConfig, train_grpo
    from trainers.rewards.graders import build_grader
    from trainers.rewards.reward_set import RewardSet

    if mode == "in_ram":
        rows = list(rows)
        # the tokenized prompts as the list of RLPrompt the RL methods kept before the store
        trainers.families.rl.tokenize_rl_rows = lambda *a, **k: list(tokenize_rl_rows(*a, **k))  # type: ignore[attr-defined]
    grader = {"type": "string_check", "name": "a", "operation": "like", "input": "{{sample.output_text}}"}
    rewards = RewardSet.of([build_grader({**grader, "reference": "{{item.answer}}"})])
    config = GRPOConfig(
        str(model), str(out), max_steps=1, batch_size=2, num_generations=2, max_completion_length=4, seed=0
    )
    train_grpo(config, rows, rewards=rewards)


def _config(model: Path, out: Path) -> SFTConfig:
    from trainers.methods.sft import SFTConfig

    return SFTConfig(str(model), str(out), max_steps=2, batch_size=8, max_length=256, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes-mb", default="1,50,200")
    parser.add_argument("--method", choices=("sft", "grpo"), default="sft")
    parser.add_argument("--child", nargs=4, metavar=("MODE", "DATA", "MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, data, model, out = args.child
        child(mode, Path(data), Path(model), Path(out), args.method)
        return

    from trainers.modeling.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="tunehouse-data-memory-") as tmp_name:
        tmp = Path(tmp_name)
        model = build_tiny_model(tmp / "tiny")
        print("| file | rows | on disk: peak RSS MiB | in RAM: peak RSS MiB | ratio | on disk s | in RAM s |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for size in (float(s) for s in args.sizes_mb.split(",")):
            data = tmp / f"train-{size:g}mb.jsonl"
            n_rows = write_rows(data, size, method=args.method)
            result = {}
            for mode in MODES:
                done = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "bench.data_memory",
                        "--child",
                        mode,
                        str(data),
                        str(model),
                        str(tmp / mode),
                        "--method",
                        args.method,
                    ],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    check=True,
                    # the store's spill files go to the temp dir, as they go to the job's folder in the worker
                    env={**os.environ, "TMPDIR": str(tmp)},
                )
                result[mode] = json.loads(done.stdout.strip().splitlines()[-1])
            disk, ram = result["on_disk"], result["in_ram"]
            ratio = disk["peak_mib"] / ram["peak_mib"]
            print(
                f"| {size:g} MB | {n_rows} | {disk['peak_mib']:.0f} | {ram['peak_mib']:.0f} | {ratio:.2f}× "
                f"| {disk['seconds']:.0f} | {ram['seconds']:.0f} |",
                flush=True,
            )
            data.unlink()


if __name__ == "__main__":
    main()
