"""Multi-LoRA batching against interleaving, for LoRA jobs on one shared base: is one forward and backward
of the base over every job's rows quicker than each job's own forward and backward in turn?

    python -m bench.multi_lora_batching                         # SmolLM2-135M, on this host's device
    python -m bench.multi_lora_batching --precision bf16 --width 512
    python -m bench.multi_lora_batching --model PATH --device cuda --rows 8   # on a GPU machine

``--jobs`` jobs (4), each a micro-batch of ``--rows`` rows of ``--width`` tokens, a LoRA adapter of rank
8 of its own on every linear layer, the trainer's kernels (``trainers.kernels.install``) and SFT's loss
on every token:
- **interleaved**: each job's forward and backward in turn, through its own adapter; what the shared
  base runs (``trainers/families/shared_base.py``);
- **batched, lower bound**: one forward and backward of all the jobs' rows through one adapter. A real
  multi-LoRA batch routes each job's rows through its own adapter: the same rank-r products, plus the
  routing's gathers and scatters. So it costs at least this, and where this is no quicker than
  interleaving, batching cannot be either.
It prints the median of ``--repeats`` timed rounds after a warm-up round, and ``batched / interleaved``:
above 1, interleaving is the quicker.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel

from trainers.core.precision import autocast_dtype, computing_in
from trainers.kernels.install import install_kernels
from trainers.losses.causal_lm import linear_cross_entropy
from trainers.methods.sft import SFTConfig
from trainers.modeling.loading import decoder_and_head, load_model, lora_config


def measure(
    model_path: Path,
    *,
    device: torch.device,
    precision: str,
    jobs: int = 4,
    rows: int = 4,
    width: int = 256,
    repeats: int = 3,
) -> dict[str, Any]:
    """Seconds of one round of interleaved and of batched passes (medians), and their ratio."""
    # a LoRA SFT job's model settings (r 8 on every linear layer, no dropout: the trainer's defaults)
    settings = SFTConfig(str(model_path), output_dir="", use_lora=True, mixed_precision=precision)
    model = load_model(settings, device, adapter_name="job0")
    assert isinstance(model, PeftModel)
    for index in range(1, jobs):
        model.add_adapter(f"job{index}", lora_config(settings, model))
    install_kernels(model, settings, device)
    model.train()
    dtype = autocast_dtype(precision, device)
    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (rows, width), generator=generator).to(device) for _ in range(jobs)]

    split = decoder_and_head(model)
    assert split is not None, "a model whose logits are hidden @ W.T (as SFT's loss runs it)"
    decoder, head = split

    def pass_of(adapter: str, input_ids: torch.Tensor) -> None:
        """SFT's forward and backward (``trainers.methods.sft.sft_loss``), every token a target."""
        model.set_adapter(adapter)
        with computing_in(model, dtype, device):
            hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state[:, :-1]
            sums = linear_cross_entropy(hidden.flatten(0, 1), head.weight, input_ids[:, 1:].flatten())
        sums.loss_sum.backward()  # type: ignore[no-untyped-call]

    def interleaved() -> None:
        for index, batch in enumerate(batches):
            pass_of(f"job{index}", batch)

    def batched() -> None:
        pass_of("job0", torch.cat(batches))

    def timed(run: Any) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    timed(interleaved), timed(batched)  # warm-up: allocator, kernels' first calls
    seconds: dict[str, list[float]] = {"interleaved": [], "batched": []}
    for _ in range(repeats):  # alternated, so a slower moment of the host hits both
        seconds["interleaved"].append(timed(interleaved))
        seconds["batched"].append(timed(batched))
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    return {
        "device": str(device),
        "precision": precision,
        "jobs": jobs,
        "rows": rows,
        "width": width,
        "interleaved_s": round(medians["interleaved"], 3),
        "batched_lower_bound_s": round(medians["batched"], 3),
        "batched_over_interleaved": round(medians["batched"] / medians["interleaved"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="a Hugging Face model folder (default: SmolLM2-135M)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="auto", choices=("auto", "no", "bf16"))
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.model is None:
        from bench.trainers_vs_trl import smollm2_path

        args.model = smollm2_path()
    result = measure(
        args.model,
        device=torch.device(args.device),
        precision=args.precision,
        jobs=args.jobs,
        rows=args.rows,
        width=args.width,
        repeats=args.repeats,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
