"""The GPU suite: our trainers against TRL's at the sizes users train, on one GPU, in one command.

    make bench-gpu                          # the whole suite on CUDA, within 8 minutes
    make bench-gpu ARGS="--smoke"           # the same code on a CPU with tiny shapes (make test runs it)
    python -m bench.gpu_suite --only qwen2.5-1.5b:sft_lora --budget-s 120
    python -m bench.gpu_suite --correctness         # only the loss checks (~2 minutes on a GPU)

On the device machine (docs/gpu-bench.md has the why; the suite ends within 480 s):

    bash bench/gpu_wheels.sh        # here, once: the wheels the GPU image lacks, into .whl/ (~20 MB)
    run(command="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;
        PYTHONUNBUFFERED=1 python3 -m bench.gpu_suite --out $OUT", carry=[".whl"], timeout_s=540)

What it measures, per cell (a model, a method, a lever; ours and TRL's trainer, each in its own child
process so that ``torch.cuda.max_memory_allocated`` is that run's own):
- **models**: random-initialised from configs written here (``MODELS``; nothing downloads), Qwen2.5-0.5B,
  Qwen2.5-1.5B and Llama-3.1-8B shapes on transformers' Llama architecture (the Qwen shapes with biased
  projections; Llama's ``attention_bias`` also biases ``o_proj``, d more weights a layer). The tiny model's
  tokenizer (512 ids, a subset of every vocabulary) cuts rows of random corpus words; the head spans
  the full vocabulary, so its cost is the real model's.
- **methods**: SFT LoRA and full (full up to 1.5B), DPO LoRA, GRPO LoRA (both sides sampling with
  transformers' ``generate``); rows of 2k-4k tokens (``WORKLOADS``), the first optimizer step a warm-up.
- **rates**: real (non-pad) tokens/s for SFT, pairs/s for DPO, completions/s for GRPO, over the steps
  after the first; MFU for SFT by ``bench/model_flops.py``'s formula (6 FLOPs per weight and token for
  full fine-tuning, 4 for LoRA, plus 12·L·d·t² for attention), against the dense bf16 datasheet peak
  (989 TFLOP/s, H100/H200 SXM) and, as ``mfu_measured``, the 8192³ bf16 matmul rate this run measured.
- **levers**, each on and off (``LEVERS``): liger-kernel's RMSNorm/RoPE/SwiGLU, ``torch.compile`` of the
  decoder layers, bitsandbytes QLoRA (4-bit base, gradient checkpointing on both sides), sdpa's cuDNN
  attention and packed rows through flash attention's variable-length kernel (ours only). A lever whose
  package is missing is a row "not installed", one that needs CUDA is "needs CUDA" on a CPU, never a
  crash; CUDA graphs are "not built" (micro-batches change length every step).
- **correctness** (``correctness``): our SFT loss against TRL's ``compute_loss`` on one batch on the
  device (bf16 autocast on CUDA: |Δ| ≤ 1e-2 × loss; fp32 on a CPU: 1e-4 × loss), the first-step
  losses of the rows that train the same batch with the same loss (SFT, DPO: 1e-3 × loss), and on a
  GPU the trainer tests that take its path (``PYTEST_FILES``, their own tolerances; ``pytest``).

Cells run in ``PLAN``'s order, most important first, until ``--budget-s`` is spent; the rest are rows
"skipped" with that reason. The results (schema ``SCHEMA``) are rewritten after every cell to
``bench/results/gpu-<date>-<gpu>.json`` (``--results-dir``) and to ``--out``, so a run cut short keeps
what it measured; the markdown table is printed and written next to them.

``--smoke`` runs the same cell code on the CPU with the ``smoke`` model and shapes, setup and cells in
one child process (a CPU has no per-run device peak to keep apart, and 2 shared cores take ~8 s to
start a child): tests/test_gpu_bench_smoke.py checks its results file, so the suite cannot rot between
GPU runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.model_flops import H200_BF16_DENSE_PEAK
from bench.trainers_vs_trl import PRECISION_VARIABLE, RANDOM_CONFIGS, ROOT, Size

SCHEMA = 1
RESULTS_DIR = ROOT / "bench" / "results"
CACHE_VARIABLE = "TUNEHOUSE_BENCH_CACHE"  # bench/trainers_vs_trl.py's cache (the tiny model's tokenizer)
# pairs of cells start within the budget (from the suite's start: the models' build and the tests count);
# no child runs past the budget + OVERRUN_S, so the suite ends within 8 minutes
DEFAULT_BUDGET_S = 390.0
OVERRUN_S = 90.0
SMOKE_BUDGET_S = 300.0
CELL_TIMEOUT_S = 300.0  # one child; an 8B cell loads 16 GB and takes ~30 s on an H100
SEED = 0
RESULT_PREFIX = "gpu-suite-result "  # a child's result lines (Trainer prints its logs to stdout too)
IMPLS = ("ours", "trl")

# Shapes only (random weights): transformers' Llama architecture for all three (see the docstring)
MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": RANDOM_CONFIGS["llama-0.5b-random"],  # the CPU/GPU trainers bench's 0.5B shapes
    "qwen2.5-1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "attention_bias": True,
    },
    "llama3.1-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "smoke": {  # --smoke: a CPU trains it in a second a cell
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "tie_word_embeddings": False,
    },
}
# saved in bf16 where only LoRA trains it (both sides load the frozen base in bf16): 16 GB, not 32
BF16_ON_DISK = {"llama3.1-8b"}

# rows of random corpus words, ~1.9 tokens a word with the tiny tokenizer: SFT rows of ~2.1k-4k tokens
# (max_length 4,096), DPO rows (prompt + one answer) of ~2k-3.3k, GRPO prompts of ~0.6k-1.7k + 128 new
_SFT_WORDS = {"prompt_words": (100, 300), "completion_words": (1000, 1800)}
_DPO_WORDS = {"prompt_words": (100, 300), "completion_words": (900, 2800)}  # each answer 900-1,400
_GRPO_WORDS = {"prompt_words": (300, 900), "completion_words": (1, 2)}


def _size(rows: int, steps: int, words: dict[str, tuple[int, int]], **kw: int) -> Size:
    fields = {"grad_accum": 1, "max_length": 4096, "grpo_prompts": 1, "grpo_new_tokens": 128} | kw
    return Size(n_rows=rows * steps, batch_size=rows, steps=steps, **words, **fields)  # type: ignore[arg-type]


# (model, method) -> the workload. SFT and DPO: 4 steps (3 timed); GRPO: 3 rollouts (2 timed) of
# grpo_prompts x 4 completions. Micro-batches sized for 80 GB with neither side checkpointing.
WORKLOADS: dict[tuple[str, str], Size] = {
    **{(m, "sft_lora"): _size(4, 4, _SFT_WORDS) for m in ("qwen2.5-0.5b", "qwen2.5-1.5b")},
    **{(m, "sft_full"): _size(4, 4, _SFT_WORDS) for m in ("qwen2.5-0.5b", "qwen2.5-1.5b")},
    **{(m, "dpo"): _size(2, 4, _DPO_WORDS) for m in ("qwen2.5-0.5b", "qwen2.5-1.5b")},
    **{(m, "grpo"): _size(4, 3, _GRPO_WORDS, grpo_prompts=4) for m in ("qwen2.5-0.5b", "qwen2.5-1.5b")},
    # one row of ~3.6k-4k tokens a step: the "8B LoRA at 4k context on one 80 GB GPU" target
    ("llama3.1-8b", "sft_lora"): _size(1, 4, {"prompt_words": (300, 400), "completion_words": (1600, 1800)}),
    # --smoke: the same methods, a few short rows
    ("smoke", "sft_lora"): _size(
        2, 3, {"prompt_words": (5, 20), "completion_words": (10, 40)}, max_length=128
    ),
    ("smoke", "sft_full"): _size(
        2, 3, {"prompt_words": (5, 20), "completion_words": (10, 40)}, max_length=128
    ),
    ("smoke", "dpo"): _size(2, 3, {"prompt_words": (5, 20), "completion_words": (10, 40)}, max_length=128),
    ("smoke", "grpo"): _size(
        2, 3, {"prompt_words": (5, 20), "completion_words": (1, 2)}, grpo_prompts=1, grpo_new_tokens=8
    ),
}
SFT_METHODS = {"sft_lora", "sft_full"}
COMPARED_LOSSES = {"sft_lora", "sft_full", "dpo"}  # the same batch and loss on both sides


@dataclass(frozen=True)
class Lever:
    """A switch measured on (its rows) against off (the ``base`` rows of the same model and method)."""

    name: str
    package: str | None  # the module that must import; None: torch alone
    needs_cuda: bool
    sides: tuple[str, ...]  # the implementations it applies to
    what: str


LEVERS: dict[str, Lever] = {
    "base": Lever("base", None, False, IMPLS, "each side as it comes: bf16 autocast, sdpa attention"),
    "liger": Lever(
        "liger",
        "liger_kernel",
        True,
        IMPLS,
        "liger-kernel's RMSNorm, RoPE and SwiGLU on transformers' Llama classes, before either side loads "
        "(TRL's `use_liger_kernel` does the same; each keeps its own chunked LM-head loss). Ours installs "
        "its own MLP and RMSNorm forwards per layer (trainers/kernels/activation_memory.py), so on ours "
        "only RoPE "
        "takes effect",
    ),
    "compile": Lever(
        "compile",
        None,
        True,
        IMPLS,
        "torch.compile(dynamic=True) of every decoder layer, applied as the model loads, on both sides",
    ),
    "qlora": Lever(
        "qlora",
        "bitsandbytes",
        True,
        IMPLS,
        "bitsandbytes NF4 base (double quantisation, bf16 compute) with gradient checkpointing, both sides",
    ),
    "cudnn": Lever(
        "cudnn",
        None,
        True,
        ("ours",),
        "ours with sdpa's cuDNN backend left on (a trainer turns it off on CUDA: modeling."
        "use_plan_free_attention); TRL has it on as torch does by default",
    ),
    "varlen": Lever(
        "varlen",
        None,
        True,
        ("ours",),
        "ours with `packing`: rows packed without padding, attention through flash attention's "
        "variable-length kernel (trainers/kernels/varlen_attention.py); TRL's padding-free path needs the "
        "flash-attn package",
    ),
}
NOT_BUILT = {
    "cuda_graphs": "not built: micro-batches are padded to their own longest row, so shapes change every "
    "step and a captured graph would not replay; `compile` is the host-overhead lever measured",
}


@dataclass(frozen=True)
class Cell:
    model: str
    method: str
    lever: str
    impl: str

    @property
    def key(self) -> str:
        return f"{self.model}:{self.method}:{self.lever}:{self.impl}"


# Most important first: the targets (1.5B and 8B), then 0.5B, then the levers on and off.
PLAN: list[tuple[str, str, str]] = [
    ("qwen2.5-1.5b", "sft_lora", "base"),
    ("qwen2.5-1.5b", "sft_full", "base"),
    ("llama3.1-8b", "sft_lora", "base"),
    ("qwen2.5-1.5b", "dpo", "base"),
    ("qwen2.5-1.5b", "grpo", "base"),
    ("llama3.1-8b", "sft_lora", "qlora"),
    ("qwen2.5-1.5b", "sft_full", "liger"),
    ("qwen2.5-1.5b", "sft_lora", "varlen"),
    ("qwen2.5-1.5b", "sft_lora", "cudnn"),
    ("qwen2.5-0.5b", "sft_lora", "base"),
    ("qwen2.5-0.5b", "sft_full", "base"),
    ("qwen2.5-0.5b", "sft_lora", "compile"),
    ("qwen2.5-1.5b", "sft_lora", "liger"),
    ("qwen2.5-0.5b", "dpo", "base"),
    ("qwen2.5-0.5b", "grpo", "base"),
]
# --correctness: the cells whose first-step losses are compared, at the smallest size, then PYTEST_FILES
CORRECTNESS_PLAN: list[tuple[str, str, str]] = [("qwen2.5-0.5b", m, "base") for m in sorted(COMPARED_LOSSES)]
# trainer tests that take the CUDA path where there is one (the chunked head and the layers that keep less
# for backward against transformers' own forwards, under bf16 autocast); run with --confcutdir so that
# tests/conftest.py (the service's fixtures, whose packages the device lacks) is not loaded
PYTEST_FILES = (
    "tests/trainers/losses/test_losses.py",
    "tests/trainers/modeling/test_target_log_probs.py",
    "tests/trainers/core/test_precision.py",
    "tests/trainers/kernels/test_activation_memory.py",
)
PYTEST_TIMEOUT_S = 240.0
SMOKE_PLAN: list[tuple[str, str, str]] = [
    ("smoke", "sft_lora", "base"),
    ("smoke", "sft_full", "base"),
    ("smoke", "dpo", "base"),
    ("smoke", "grpo", "base"),
    *[("smoke", "sft_lora", lever) for lever in LEVERS if lever != "base"],
]


def cells_of(plan: list[tuple[str, str, str]]) -> list[Cell]:
    return [Cell(m, method, lever, impl) for m, method, lever in plan for impl in LEVERS[lever].sides]


# -- the child: one or more items in this process -------------------------------------------------------
def _cache() -> Path:
    return Path(os.environ.get(CACHE_VARIABLE, Path.home() / ".cache" / "tunehouse-bench"))


def model_dir(name: str) -> Path:
    return _cache() / "gpu-suite" / name


def build_model(name: str) -> dict[str, Any]:
    """``MODELS[name]`` with random weights (seed 0) and the tiny model's tokenizer, saved once; built on
    the GPU where there is one (an 8B model's initialisation takes minutes on a CPU)."""
    out = model_dir(name)
    if (out / "config.json").exists():
        return {"kind": "build", "model": name, "status": "ok", "reason": "cached"}
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from bench.trainers_vs_trl import model_path

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_path("tiny"))
    tokenizer.model_max_length = 8192  # rows of 4k tokens; the tiny model says 2,048
    config = LlamaConfig(
        **MODELS[name],
        max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and name != "smoke":  # minutes and 32 GB of RAM for 8B, for cells that won't run
        return {"kind": "build", "model": name, "status": "skipped", "reason": "no GPU here"}
    dtype = torch.bfloat16 if name in BF16_ON_DISK else torch.float32
    previous = torch.get_default_dtype()
    try:  # initialised in the dtype it is saved in: an 8B model in fp32 would take 32 GB first
        torch.set_default_dtype(dtype)
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(SEED)
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    partial = out.with_name(out.name + ".partial")  # a run killed mid-write leaves no half model behind
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    del model
    seconds = time.perf_counter() - started
    return {"kind": "build", "model": name, "status": "ok", "reason": f"built in {seconds:.0f} s"}


def probe() -> dict[str, Any]:
    """The machine: GPU name, memory, the measured bf16 matmul rate, library versions."""
    import platform

    import torch

    versions = {}
    for package in ("torch", "transformers", "trl", "peft", "datasets", "liger_kernel", "bitsandbytes"):
        try:
            module = __import__(package)
            versions[package] = getattr(module, "__version__", "?")
        except Exception as exc:  # a package that is missing or fails to import: recorded, not fatal
            versions[package] = f"not installed ({type(exc).__name__})"
    info: dict[str, Any] = {
        "kind": "probe",
        "status": "ok",
        "python": platform.python_version(),
        "versions": versions,
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        from bench.model_flops import measured_bf16_matmul_rate

        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpu": torch.cuda.get_device_name(),
            "gpu_memory_gib": props.total_memory / 2**30,
            "cuda": torch.version.cuda,
            "matmul_bf16_flops": measured_bf16_matmul_rate(),
        }
    else:
        info |= {"gpu": None, "gpu_memory_gib": None, "cuda": None, "matmul_bf16_flops": None}
    return info


def apply_lever(lever: str) -> None:
    """Put ``lever`` in place in this process, before any model loads (a child runs one lever)."""
    if lever == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
        )
    elif lever == "cudnn":
        from bench import ours

        ours.keep_cudnn_attention()
    elif lever in ("compile", "qlora"):
        _wrap_from_pretrained(lever)


def _wrap_from_pretrained(lever: str) -> None:
    """Both sides load the policy with ``LlamaForCausalLM.from_pretrained`` (through the Auto class):
    the lever goes in there, identically for ours and TRL's."""
    import torch
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    original = LlamaForCausalLM.from_pretrained.__func__  # type: ignore[attr-defined]

    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        if lever == "qlora":
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16,
            )
            kwargs["device_map"] = {"": torch.cuda.current_device()}
        model = original(cls, *args, **kwargs)
        if lever == "compile":
            # a run's micro-batches differ in length: dynamic shapes, and room for every layer's guards
            torch._dynamo.config.cache_size_limit = 256
            torch._dynamo.config.accumulated_cache_size_limit = 4096
            for layer in model.model.layers:
                layer.compile(dynamic=True)
        return model

    LlamaForCausalLM.from_pretrained = classmethod(from_pretrained)  # type: ignore[method-assign, assignment]


def overrides(cell: Cell) -> dict[str, Any]:
    """Config fields the cell sets on its side beyond what bench/trainers_vs_trl.py's runners set."""
    extra: dict[str, Any] = {}
    if cell.lever == "qlora":
        extra["gradient_checkpointing"] = True  # QLoRA's recipe: the 8B target is "within 24 GB"
    if cell.impl == "ours" and cell.method == "grpo":
        extra["max_prompt_length"] = 4096  # ours keeps 512 by default; TRL 1.16 does not truncate
    if cell.impl == "trl" and cell.method == "sft_full":
        extra["model_init_kwargs"] = {"dtype": "float32"}  # fp32 weights, as ours (not the bf16 "auto")
    return extra


def run_cell(cell: Cell) -> dict[str, Any]:
    """One measurement in this process: the trainer's steps, its rate, peak memory, MFU, first loss."""
    import torch

    from bench import trainers_vs_trl as tvt

    size = WORKLOADS[(cell.model, cell.method)]
    method = "sft_packed" if cell.lever == "varlen" else cell.method
    model = model_dir(cell.model)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        torch.manual_seed(SEED)
        if cell.impl == "ours":
            clock = tvt.run_ours(
                method, model, size, Path(out), SEED, overrides=overrides(cell), final_checkpoint=False
            )
        else:
            clock = tvt.run_trl(method, model, size, Path(out), SEED, overrides=overrides(cell))
        wrote = any(Path(out).rglob("*.safetensors"))  # neither side should spend the cell's time on it
    units, rate = tvt.rate_of(method, size, clock)
    row: dict[str, Any] = {
        "units": units,
        "rate": rate,
        "tokens_per_s": sum(clock.tokens[1:]) / (clock.ends[-1] - clock.ends[0]) if clock.tokens else None,
        "step_s": (clock.ends[-1] - clock.ends[0]) / (len(clock.ends) - 1),
        "first_step_s": clock.ends[0] - clock.start,
        "steps": len(clock.ends),
        "first_loss": clock.first_loss,
        "wrote_checkpoint": wrote,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_memory_reason": None if cuda else "CPU: no per-run peak of device memory (RSS is per process)",
        "tflops": None,
        "mfu": None,
        "mfu_reason": "SFT rows only (the formula counts a training pass over the rows' tokens)",
    }
    if cell.method in SFT_METHODS:
        flops = tvt.sft_flop_rate(model, size, rate, lora=cell.method == "sft_lora")
        row["tflops"] = flops / 1e12
        row["mfu"] = flops / H200_BF16_DENSE_PEAK if cuda else None
        row["mfu_reason"] = None if cuda else "CPU: no bf16 peak to divide by"
    return row


def check_sft_loss() -> dict[str, Any]:
    """Our SFT loss against TRL's ``compute_loss`` on one batch of TRL's collator, same model, on this
    device: bf16 autocast on CUDA (the products round to 8 bits of mantissa; the chunked head and TRL's
    fused one round differently, hence 1e-2 x loss), fp32 on a CPU (1e-4 x loss)."""
    import warnings

    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench import ours
    from bench.trainers_vs_trl import make_rows
    from bench.trainers_vs_trl import model_path as tvt_model_path

    datasets.disable_progress_bars()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    path = model_dir("smoke")
    rows = make_rows(WORKLOADS[("smoke", "sft_lora")])["sft"][:4]
    tokenizer = AutoTokenizer.from_pretrained(tvt_model_path("tiny"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = torch.nn.Module.to(model, device).eval()  # (transformers' typed `to` rejects a device)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trl.SFTConfig(
            output_dir=out,
            report_to="none",
            completion_only_loss=True,
            per_device_train_batch_size=len(rows),
            max_length=128,
            use_cpu=not cuda,
            bf16=cuda,
            seed=SEED,
        )
        trainer = trl.SFTTrainer(
            model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer
        )
        batch = {k: v.to(device) for k, v in next(iter(trainer.get_train_dataloader())).items()}
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
        with torch.no_grad(), autocast:
            reference = float(trainer.compute_loss(trainer.model, dict(batch)))
            labels = batch["labels"]
            ours_batch = ours.SFTBatch(
                input_ids=batch["input_ids"],
                labels=labels,
                attention_mask=batch["attention_mask"],
                position_ids=None,
                n_targets=int((labels[:, 1:] != ours.IGNORE_INDEX).sum()),
                n_inputs=int(batch["attention_mask"].sum()),
                logit_positions=ours.target_positions(labels),
            )
            value = float(ours.sft_loss(model, ours_batch).loss) / ours_batch.n_targets
    tolerance = (1e-2 if cuda else 1e-4) * abs(reference)
    return {
        "kind": "check",
        "check": "sft loss, one batch: ours vs TRL compute_loss",
        "precision": "bf16 autocast" if cuda else "fp32",
        "ours": value,
        "reference": reference,
        "abs_diff": abs(value - reference),
        "tolerance": tolerance,
        "passed": abs(value - reference) <= tolerance,
        "status": "ok",
    }


def child(items: list[dict[str, Any]]) -> None:
    """Run ``items`` in order in this process, one JSON line each on stdout (a failure is its line). The
    cells among them share one lever, put in place before the first (it patches the process)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        import datasets

        datasets.disable_progress_bars()  # TRL's dataset preparation, in the log for every cell
    except ImportError:  # the probe says so; the TRL cells fail with it
        pass
    levers = {item["lever"] for item in items if item["kind"] == "cell"}
    lever_error = None
    if len(levers) > 1:
        lever_error = f"levers {sorted(levers)} in one child: a lever runs in a child of its own"
    elif levers:
        try:
            apply_lever(levers.pop())
        except Exception as exc:  # every cell of the child reports it
            lever_error = f"the lever failed to apply: {type(exc).__name__}: {exc}"
    for item in items:
        started = time.perf_counter()
        try:
            if item["kind"] == "probe":
                result = probe()
            elif item["kind"] == "build":
                result = build_model(item["model"])
            elif item["kind"] == "check":
                result = check_sft_loss()
            elif lever_error:
                raise RuntimeError(lever_error)
            else:
                cell = Cell(item["model"], item["method"], item["lever"], item["impl"])
                result = {**item, "status": "ok", "reason": None, **run_cell(cell)}
        except Exception as exc:  # a cell's failure is its row (OOM, a lever's bug)
            tail = traceback.format_exc().strip().splitlines()[-6:]
            result = {
                **item,
                "status": "error",
                "reason": f"{type(exc).__name__}: {exc}"[:600],
                "trace": tail,
            }
        result["wall_s"] = time.perf_counter() - started
        print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)


# -- the parent: plan, children, results ----------------------------------------------------------------
def run_children(items: list[dict[str, Any]], timeout: float, log: Path | None) -> list[dict[str, Any]]:
    """``items`` in one child process; a child that dies or times out turns its missing items into
    errors with its stderr's tail."""
    command = [sys.executable, "-m", "bench.gpu_suite", "--child", json.dumps(items)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        stdout, stderr, why = done.stdout, done.stderr, f"child exited with {done.returncode}"
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        why = f"timed out after {timeout:.0f} s"
    if log is not None:
        with log.open("a", encoding="utf-8") as f:
            f.write(f"$ {' '.join(command[:4])} {json.dumps(items)}\n{stderr[-20000:]}\n")
    lines = stdout.splitlines()
    results = [
        json.loads(line.removeprefix(RESULT_PREFIX)) for line in lines if line.startswith(RESULT_PREFIX)
    ]
    for item in items[len(results) :]:
        results.append({**item, "status": "error", "reason": f"{why}: {stderr[-600:]}"})
    return results


def run_pytest(timeout: float, log: Path | None) -> dict[str, Any]:
    """``PYTEST_FILES`` on this machine's device: the summary line, and the tail of a failure."""
    command = [sys.executable, "-m", "pytest", *PYTEST_FILES, "--confcutdir=tests/trainers", "-q"]
    command += ["-p", "no:cacheprovider"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        code = None
    if log is not None:
        with log.open("a", encoding="utf-8") as f:
            f.write(f"$ {' '.join(command)}\n{output[-20000:]}\n")
    lines = [line for line in output.splitlines() if line.strip()]
    return {
        "command": " ".join(["python -m pytest", *command[3:]]),
        "returncode": code,
        "passed": code == 0,
        "summary": lines[-1] if lines else "no output",
        "tail": None if code == 0 else lines[-30:],
    }


def availability(lever: Lever, cuda: bool) -> str | None:
    """Why ``lever`` cannot run here (a row's status and reason), or None."""
    if lever.package and importlib.util.find_spec(lever.package) is None:
        return f"not installed: {lever.package}"
    if lever.needs_cuda and not cuda:
        return "needs CUDA"
    return None


def gpu_slug(name: str | None) -> str:
    if not name:
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower().removeprefix("nvidia ")).strip("-")


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours against TRL per (model, method, lever); an ours-only lever against TRL's base row, and every
    lever against ours' base row (its gain)."""
    ok = {(r["model"], r["method"], r["lever"], r["impl"]): r for r in rows if r["status"] == "ok"}
    out = []
    for model, method, lever in dict.fromkeys((r["model"], r["method"], r["lever"]) for r in rows):
        mine = ok.get((model, method, lever, "ours"))
        theirs = ok.get((model, method, lever, "trl")) or ok.get((model, method, "base", "trl"))
        base = ok.get((model, method, "base", "ours"))
        entry: dict[str, Any] = {"model": model, "method": method, "lever": lever}
        entry["speed_ratio"] = mine["rate"] / theirs["rate"] if mine and theirs else None
        mem = (mine or {}).get("peak_memory_gib"), (theirs or {}).get("peak_memory_gib")
        entry["memory_ratio"] = mem[0] / mem[1] if mem[0] and mem[1] else None
        mine_loss, theirs_loss = (mine or {}).get("first_loss"), (theirs or {}).get("first_loss")
        same_batch = method in COMPARED_LOSSES and lever not in ("qlora", "varlen")  # 4-bit, packed: not
        entry["loss_delta"] = None
        if same_batch and mine_loss is not None and theirs_loss is not None:
            entry["loss_delta"] = abs(mine_loss - theirs_loss)
        entry["gain_over_base"] = mine["rate"] / base["rate"] if mine and base and lever != "base" else None
        out.append(entry)
    return out


def loss_checks(comparisons: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first-step losses of ours and TRL on the same batch (1e-3 x loss: bf16 on both sides)."""
    checks = []
    trl = {(r["model"], r["method"]): r for r in rows if r["impl"] == "trl" and r["status"] == "ok"}
    for c in comparisons:
        if c["loss_delta"] is None or c["lever"] != "base":
            continue
        reference = trl[(c["model"], c["method"])]["first_loss"]
        tolerance = 1e-3 * abs(reference)
        checks.append(
            {
                "kind": "check",
                "check": f"first-step loss, {c['model']} {c['method']}: ours vs TRL",
                "abs_diff": c["loss_delta"],
                "reference": reference,
                "tolerance": tolerance,
                "passed": c["loss_delta"] <= tolerance,
                "status": "ok",
            }
        )
    return checks


def _ratio(comparisons: list[dict[str, Any]], model: str, method: str, key: str) -> float | None:
    for c in comparisons:
        if (c["model"], c["method"], c["lever"]) == (model, method, "base"):
            value: float | None = c[key]
            return value
    return None


def _row(rows: list[dict[str, Any]], model: str, method: str, lever: str, impl: str) -> dict[str, Any]:
    return next(
        (r for r in rows if (r["model"], r["method"], r["lever"], r["impl"]) == (model, method, lever, impl)),
        {"status": "not planned"},
    )


def targets(rows: list[dict[str, Any]], comparisons: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets against this run (None: not measured, with the row's status as the why)."""
    out = []

    def speed(name: str, model: str, method: str, want: float) -> None:
        got = _ratio(comparisons, model, method, "speed_ratio")
        why = None if got is not None else f"ours {_row(rows, model, method, 'base', 'ours')['status']}, "
        why = why and why + f"TRL {_row(rows, model, method, 'base', 'trl')['status']}"
        out.append(
            {
                "target": name,
                "want": f">= {want}x TRL",
                "got": got,
                "met": None if got is None else got >= want,
                "why": why,
            }
        )

    speed("SFT LoRA speed, 1.5B", "qwen2.5-1.5b", "sft_lora", 1.3)
    speed("SFT LoRA speed, 8B", "llama3.1-8b", "sft_lora", 1.3)
    speed("full SFT speed, 1.5B", "qwen2.5-1.5b", "sft_full", 1.2)
    full = _row(rows, "qwen2.5-1.5b", "sft_full", "base", "ours")
    mfu = full.get("mfu")
    out.append(
        {
            "target": "full SFT MFU, 1.5B",
            "want": ">= 40%",
            "got": mfu,
            "met": None if mfu is None else mfu >= 0.4,
            "why": None if mfu is not None else full["status"],
        }
    )
    speed("DPO speed, 1.5B", "qwen2.5-1.5b", "dpo", 1.5)
    speed("GRPO speed, 1.5B", "qwen2.5-1.5b", "grpo", 1.5)
    ratios = [c["memory_ratio"] for c in comparisons if c["lever"] == "base" and c["memory_ratio"]]
    worst = max(ratios) if ratios else None
    out.append(
        {
            "target": "peak memory, every base row",
            "want": "<= 0.7x TRL",
            "got": worst,
            "met": None if worst is None else worst <= 0.7,
            "why": None if ratios else "no pair measured",
        }
    )
    for lever, limit in (("base", 80.0), ("qlora", 24.0)):
        row = _row(rows, "llama3.1-8b", "sft_lora", lever, "ours")
        peak = row.get("peak_memory_gib")
        name = "8B LoRA at 4k on 80 GB" if lever == "base" else "8B QLoRA at 4k within 24 GB"
        met = (
            None
            if row["status"] not in ("ok", "error")
            else bool(peak is not None and peak * 2**30 / 1e9 <= limit)
        )
        out.append(
            {
                "target": name,
                "want": f"peak <= {limit:.0f} GB",
                "got": peak,
                "met": met,
                "why": row.get("reason") or row["status"],
            }
        )
    return out


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "–" if value is None else format(value, spec) + suffix


TABLE_HEAD = (
    "model",
    "method",
    "lever",
    "units",
    "ours",
    "TRL",
    "speed",
    "ours GiB",
    "TRL GiB",
    "memory",
    "MFU ours / TRL",
    "first-loss Δ",
    "status",
)


def markdown(results: dict[str, Any]) -> str:
    """The results as the tables docs/benchmarks.md shows: the cells, the targets, the checks."""
    gpu = results["machine"].get("gpu") or "CPU (smoke)"
    peak = H200_BF16_DENSE_PEAK / 1e12
    lines = [
        f"GPU suite, {results['date']}, {gpu}; one run per cell; MFU against {peak:.0f} TFLOP/s "
        "(dense bf16 datasheet), FLOPs by bench/model_flops.py",
        "",
        "| " + " | ".join(TABLE_HEAD) + " |",
        "|" + " --- |" * len(TABLE_HEAD),
    ]
    rows = results["rows"]
    for c in results["comparisons"]:
        mine = _row(rows, c["model"], c["method"], c["lever"], "ours")
        theirs = _row(rows, c["model"], c["method"], c["lever"], "trl")
        if theirs["status"] == "not planned":  # an ours-only lever: against TRL's base row
            theirs = _row(rows, c["model"], c["method"], "base", "trl")
        problems = [
            f"{impl} {r['status']}" + (f" ({r['reason'][:80]})" if r.get("reason") else "")
            for impl, r in (("ours", mine), ("TRL", theirs))
            if r["status"] != "ok"
        ]
        cells = [
            c["model"],
            c["method"],
            c["lever"],
            mine.get("units") or theirs.get("units") or "–",
            _fmt(mine.get("rate"), ",.1f"),
            _fmt(theirs.get("rate"), ",.1f"),
            _fmt(c["speed_ratio"], ".2f", "×"),
            _fmt(mine.get("peak_memory_gib"), ".1f"),
            _fmt(theirs.get("peak_memory_gib"), ".1f"),
            _fmt(c["memory_ratio"], ".2f", "×"),
            f"{_fmt(mine.get('mfu'), '.1%')} / {_fmt(theirs.get('mfu'), '.1%')}",
            _fmt(c["loss_delta"], ".1e"),
            "; ".join(problems) or "ok",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| target | want | got | met |", "| --- | --- | --- | --- |"]
    for t in results["targets"]:
        shown = _fmt(t["got"], ".1%" if "MFU" in t["target"] else ".2f")
        met = {True: "yes", False: "**no**", None: f"not measured ({t['why']})"}[t["met"]]
        lines.append(f"| {t['target']} | {t['want']} | {shown} | {met} |")
    lines += ["", "| correctness check | abs. difference | tolerance | passed |", "| --- | --- | --- | --- |"]
    for check in results["correctness"]:
        if check["status"] != "ok":
            lines.append(f"| {check.get('check', 'sft loss')} | – | – | error ({check['reason'][:80]}) |")
        else:
            diff, tolerance = check["abs_diff"], check["tolerance"]
            lines.append(f"| {check['check']} | {diff:.1e} | {tolerance:.1e} | {check['passed']} |")
    if results.get("pytest"):
        run = results["pytest"]
        lines += ["", f"`{run['command']}`: {run['summary']}"]
    return "\n".join(lines)


def write(results: dict[str, Any], places: list[Path]) -> list[Path]:
    measured = results.get("machine", {}).get("matmul_bf16_flops")
    for row in results["rows"]:  # MFU against the matmul rate this GPU showed, beside the datasheet's
        if row["status"] == "ok" and row.get("tflops") and measured:
            row["mfu_measured"] = row["tflops"] * 1e12 / measured
    results["comparisons"] = compare(results["rows"])
    results["targets"] = targets(results["rows"], results["comparisons"])
    results["correctness"] = results["sft_checks"] + loss_checks(results["comparisons"], results["rows"])
    name = f"gpu-{results['date']}-{gpu_slug(results['machine'].get('gpu'))}"
    written = []
    for place in places:
        place.mkdir(parents=True, exist_ok=True)
        (place / f"{name}.json").write_text(
            json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8"
        )
        (place / f"{name}.md").write_text(markdown(results) + "\n", encoding="utf-8")
        written.append(place / f"{name}.json")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU, in one child (make test)"
    )
    parser.add_argument("--budget-s", type=float, default=None, help="start no cell after this many seconds")
    parser.add_argument(
        "--only", default=None, help="comma-separated model:method[:lever] entries of the plan"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="also write the results here (the device's $OUT)"
    )
    parser.add_argument(
        "--results-dir", type=Path, default=None, help="default bench/results (none with --smoke)"
    )
    parser.add_argument("--no-correctness", action="store_true", help="leave out the SFT loss check")
    parser.add_argument(
        "--correctness",
        action="store_true",
        help="only the loss checks: the SFT check, the 0.5B cells whose first losses are compared, and "
        "the trainer tests that take the CUDA path (PYTEST_FILES)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    started = time.perf_counter()
    budget = args.budget_s or (SMOKE_BUDGET_S if args.smoke else DEFAULT_BUDGET_S)
    os.environ[PRECISION_VARIABLE] = "no" if args.smoke else "bf16"  # the children inherit these
    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU, also on a GPU machine
        # one thread: on 2 shared cores torch's threads spun against each other's load (a tiny LoRA step
        # took 1.4 s with 2 threads at load 4.8, 0.02 s with 1)
        os.environ["OMP_NUM_THREADS"] = "1"
    places = [p for p in (args.results_dir or (None if args.smoke else RESULTS_DIR), args.out) if p]
    log = args.out / "gpu-suite.log" if args.out else None
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    plan = SMOKE_PLAN if args.smoke else CORRECTNESS_PLAN if args.correctness else PLAN
    if args.only:
        wanted = [tuple(spec.split(":")) for spec in args.only.split(",")]
        plan = [p for p in plan if p[:2] in wanted or p in wanted]

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - started:5.0f} s] {message}", file=sys.stderr, flush=True)

    models = list(dict.fromkeys(m for m, _, _ in plan))
    setup: list[dict[str, Any]] = [{"kind": "probe"}, *({"kind": "build", "model": m} for m in models)]
    if not args.no_correctness:
        if "smoke" not in models:  # the check's model
            setup.append({"kind": "build", "model": "smoke"})
        setup.append({"kind": "check"})
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "date": datetime.date.today().isoformat(),
        "smoke": args.smoke,
        "command": " ".join(["python -m bench.gpu_suite", *(argv if argv is not None else sys.argv[1:])]),
        "budget_s": budget,
        "flop_formula": "per example of t real tokens with k loss targets: c*N_body*t + c*V*d*k + "
        "12*L*d*t^2, c = 6 for full fine-tuning and 4 for LoRA (bench/model_flops.py)",
        "peak_bf16_flops": H200_BF16_DENSE_PEAK,
        "rows": [],
    }
    rows: list[dict[str, Any]] = results["rows"]
    pending: list[Cell] = []

    def plan_rows(cuda: bool) -> None:
        results["levers"] = {
            **{
                name: {"what": lever.what, "sides": list(lever.sides), "available": availability(lever, cuda)}
                for name, lever in LEVERS.items()
            },
            **{name: {"what": why, "available": "not built"} for name, why in NOT_BUILT.items()},
        }
        for cell in cells_of(plan):
            blocked = availability(LEVERS[cell.lever], cuda)
            row = {"kind": "cell", **dataclasses.asdict(cell), "status": "pending", "reason": blocked}
            if blocked:
                row["status"] = "not installed" if blocked.startswith("not installed") else "skipped"
            else:
                pending.append(cell)
            rows.append(row)

    def take_setup(done: list[dict[str, Any]]) -> None:
        probed = done[0]
        results["machine"] = probed if probed["status"] == "ok" else {"gpu": None, "error": probed["reason"]}
        results["builds"] = [d for d in done if d["kind"] == "build"]
        results["sft_checks"] = [d for d in done if d["kind"] == "check"]
        for item in done[1:]:
            say(f"{item['kind']} {item.get('model', '')}: {item['status']} {item.get('reason') or ''}")

    def take_cells(done: list[dict[str, Any]]) -> None:
        for result in done:
            _replace(rows, result)
            rate = f"{result['rate']:.1f} {result['units']}" if result["status"] == "ok" else result["reason"]
            say(f"  {result['model']} {result['method']} {result['lever']} {result['impl']}: {rate}")

    if args.smoke:
        # one child for all: setup and the base cells (the levers all need CUDA or a package)
        plan_rows(cuda=False)
        items = setup + [{"kind": "cell", **dataclasses.asdict(c)} for c in pending]
        say(f"one child: {len(setup)} setup items, {len(pending)} cells")
        done = run_children(items, timeout=budget, log=log)
        take_setup(done[: len(setup)])
        take_cells(done[len(setup) :])
    else:
        say(f"probe, build {', '.join(models)}" + ("" if args.no_correctness else ", SFT loss check"))
        done = run_children(setup, timeout=max(120.0, budget), log=log)
        take_setup(done)
        cuda = results["machine"].get("gpu") is not None
        plan_rows(cuda=cuda)
        unbuilt = {
            b["model"]: f"model not built: {b['reason']}" for b in results["builds"] if b["status"] != "ok"
        }
        if not cuda:  # billion-parameter cells on a CPU would only run into their timeouts
            unbuilt = {model: "no GPU here (--smoke runs the suite on a CPU)" for model in models}
        if cuda and not args.no_correctness:  # first: ~30 s, and a Done-when of the suite
            say("pytest " + " ".join(PYTEST_FILES))
            results["pytest"] = run_pytest(PYTEST_TIMEOUT_S, log)
            say(results["pytest"]["summary"])
        write(results, places)
        # a child per cell (its peak is its own, and a lever patches its process). A (model, method,
        # lever) starts only within the budget, and then its TRL cell runs too, up to the deadline: half
        # a pair compares nothing
        deadline = budget + OVERRUN_S
        started_pairs: set[tuple[str, str, str]] = set()
        for cell in pending:
            row = {"kind": "cell", **dataclasses.asdict(cell)}
            pair = (cell.model, cell.method, cell.lever)
            elapsed = time.perf_counter() - started
            if cell.model in unbuilt:
                _replace(rows, {**row, "status": "skipped", "reason": unbuilt[cell.model]})
            elif (elapsed >= budget and pair not in started_pairs) or elapsed >= deadline - 10:
                _replace(rows, {**row, "status": "skipped", "reason": "time budget spent"})
            else:
                started_pairs.add(pair)
                say(f"running {cell.key}")
                timeout = min(CELL_TIMEOUT_S, deadline - elapsed)
                take_cells(run_children([row], timeout=timeout, log=log))
            write(results, places)
    written = write(results, places)
    print(markdown(results))
    say("wrote " + (", ".join(map(str, written)) or "nothing (no --results-dir or --out)"))
    return 0


def _replace(rows: list[dict[str, Any]], result: dict[str, Any]) -> None:
    key = (result["model"], result["method"], result["lever"], result["impl"])
    for i, row in enumerate(rows):
        if (row["model"], row["method"], row["lever"], row["impl"]) == key:
            rows[i] = result
            return


if __name__ == "__main__":
    raise SystemExit(main())
