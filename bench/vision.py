"""A vision job against the same job as text, and an upload of images against one image (issue 55).

    .venv/bin/python -m bench.vision                    # the three families, ~5 minutes on 2 cores
    .venv/bin/python -m bench.vision --families gemma3 --steps 4
    .venv/bin/python -m bench.vision --families ""              # the upload alone

Training: for each family (tests/vision_families.py at its ``bench`` size: a 4-layer 256-wide language
model, a 4-layer 192-wide vision tower at 224 pixels, 64 tokens an image or an image tile) the same SFT
job (LoRA, batch 4, ``--steps`` steps after one warm-up step) runs twice in fresh child processes: on
rows that each ask about one image (a 320x240 JPEG), and on the same rows with the image parts left out
(the text job). Each child reports its peak RSS (``VmHWM``: the model, the batch's pixels, the
vision tower's forward) and the mean ``tokens_per_second`` of its steps after the first; tokens count
every input token, the images' included, so the image job's tokens/s is also reported per example.

Upload: the validator of ``POST /v1/files`` (``service.files.validation.JsonlValidator`` with its
``UploadImages``) fed a file in 1 MiB chunks, in a child process: one image of ~5 MB (a PNG of noise, a
~6.7 MB data URL, past the 4 MB line cap) against eight of them; the peak RSS of the two should be the
same (flat in the number and size of the file's images).

The ratios printed are the figures docs/benchmarks.md quotes (from one run).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _peak_rss() -> int:
    """This process's peak RSS in bytes: ``VmHWM``, which starts over at exec (``ru_maxrss`` keeps the
    high-water mark of the parent it was forked from)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rows(n: int, *, images: bool) -> list[dict[str, Any]]:
    from PIL import Image

    rows = []
    for i in range(n):
        out = io.BytesIO()
        Image.frombytes("RGB", (320, 240), os.urandom(320 * 240 * 3)).save(out, format="JPEG", quality=85)
        url = "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()
        question: Any = [{"type": "text", "text": f"Picture {i}: what does it show, in a few words?"}]
        if images:
            question.append({"type": "image_url", "image_url": {"url": url}})
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": f"Noise, number {i}, in grey and colour."},
                ]
            }
        )
    return rows


def _train_child(args: argparse.Namespace) -> None:
    """One job in this process; prints its figures as JSON."""
    from trainers.core.callbacks import NullCallbacks
    from trainers.methods.sft import SFTConfig, train_sft

    rows = [json.loads(line) for line in Path(args.rows).read_text().splitlines()]
    rates: list[float] = []

    class Steps(NullCallbacks):
        def on_step(self, row: dict[str, float]) -> None:
            rates.append(row["tokens_per_second"])

    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(
            model_path=args.model, output_dir=out, batch_size=4, max_steps=args.steps + 1, save_minutes=0
        )
        train_sft(config, rows, callbacks=Steps())
    peak = _peak_rss()
    print(json.dumps({"tokens_per_second": sum(rates[1:]) / len(rates[1:]), "peak_rss": peak}))


def _upload_file(path: Path, images: int) -> None:
    """A JSONL file of ``images`` rows, each one image of ~5 MB (a PNG of noise) as a data URL."""
    from PIL import Image

    with path.open("wb") as fh:
        for _ in range(images):
            noise = io.BytesIO()
            Image.frombytes("RGB", (1400, 1200), os.urandom(1400 * 1200 * 3)).save(noise, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(noise.getvalue()).decode()
            part = {"type": "image_url", "image_url": {"url": url}}
            row = {
                "messages": [{"role": "user", "content": [part]}, {"role": "assistant", "content": "Noise."}]
            }
            fh.write((json.dumps(row) + "\n").encode())


def _upload_child(args: argparse.Namespace) -> None:
    """The upload validator on ``args.rows``, read in 1 MiB chunks as an upload streams."""
    from service.files.validation import JsonlValidator

    before = _peak_rss()
    validator = JsonlValidator()
    with open(args.rows, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            validator.feed(chunk)
    stats = validator.finish()
    peak = _peak_rss()
    print(
        json.dumps(
            {"peak_rss": peak, "growth": peak - before, "images": stats.images, "file_bytes": stats.bytes}
        )
    )


def _child(*argv: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.vision", *argv], cwd=ROOT, capture_output=True, text=True, check=True
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="gemma3,idefics3,qwen2_5_vl")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rows", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--train-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--upload-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train_child:
        return _train_child(args)
    if args.upload_child:
        return _upload_child(args)

    sys.path.insert(0, str(ROOT))
    from tests.vision_families import build

    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for kind in ("image", "text"):
            files[kind] = Path(tmp) / f"{kind}.jsonl"
            rows = _rows(4 * (args.steps + 1), images=kind == "image")
            files[kind].write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{'family':10} {'job':6} {'tokens/s':>9} {'examples/s':>10} {'peak RSS':>9}")
        for family in [f for f in args.families.split(",") if f]:
            model = build(family, Path(tmp) / family, size="bench")
            runs = {}
            for kind in ("image", "text"):
                run = _child(
                    "--train-child",
                    "--rows",
                    str(files[kind]),
                    "--model",
                    str(model),
                    "--steps",
                    str(args.steps),
                )
                run["tokens"] = _mean_tokens(model, files[kind])
                runs[kind] = run
                per_example = run["tokens_per_second"] / run["tokens"]
                print(
                    f"{family:10} {kind:6} {run['tokens_per_second']:9.0f} {per_example:10.2f} "
                    f"{run['peak_rss'] / 2**20:8.0f}M"
                )
            image, text = runs["image"], runs["text"]
            rate = image["tokens_per_second"] / text["tokens_per_second"]
            examples = rate * text["tokens"] / image["tokens"]
            print(
                f"{family:10} image/text: tokens/s {rate:.2f}x, examples/s {examples:.2f}x, "
                f"peak RSS {image['peak_rss'] / text['peak_rss']:.2f}x, tokens an example "
                f"{image['tokens']:.0f} vs {text['tokens']:.0f}"
            )
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for n in (1, 8):
            _upload_file(Path(tmp) / f"{n}.jsonl", n)
            runs.append(_child("--upload-child", "--rows", str(Path(tmp) / f"{n}.jsonl")))
        one, eight = runs
    print(
        f"upload: 1 image ({one['file_bytes'] / 2**20:.1f} MB): validating grew the peak RSS by "
        f"{one['growth'] / 2**20:.1f}M; 8 images ({eight['file_bytes'] / 2**20:.1f} MB): "
        f"{eight['growth'] / 2**20:.1f}M "
        f"(peaks {one['peak_rss'] / 2**20:.0f}M, {eight['peak_rss'] / 2**20:.0f}M)"
    )


def _mean_tokens(model: Path, rows_file: Path) -> float:
    """Input tokens an example, as the trainer tokenizes them (images expanded by the processor)."""
    from trainers.data.sft import tokenize_sft_rows
    from trainers.data.vision import ImageFiles, VisionData
    from trainers.modeling.vision import load_processor

    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    processor = load_processor(str(model))
    examples = tokenize_sft_rows(
        rows, processor.tokenizer, max_length=8192, vision=VisionData(processor, ImageFiles())
    )
    return sum(len(e.input_ids) for e in examples) / len(examples)


if __name__ == "__main__":
    main()
