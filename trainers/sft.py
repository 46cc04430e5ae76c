"""Supervised fine-tuning (SFT): maximise the likelihood of the target tokens given their context.

    L(θ) = - (1 / |T|) Σ_{t ∈ T} log p_θ(x_t | x_<t)

where T is the set of target tokens of the step's accumulated batch: assistant turns of chat rows (those
with ``weight`` 1), completions of prompt/completion rows, every token of text rows. LoRA or full
fine-tuning, optional padding-free packing; the loop itself is ``trainers.loop``.

    python -c "
    import json; from trainers.sft import SFTConfig, train_sft; from trainers.tiny_model import *
    rows = [json.loads(line) for line in open(DEMO_SFT_PATH)]
    print(train_sft(SFTConfig(str(build_tiny_model('/tmp/tiny')), '/tmp/sft-out', max_steps=30), rows))"
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from trainers.callbacks import TrainingCallbacks, TrainResult
from trainers.collate import SFTBatch, pack_batch, pad_batch
from trainers.data import tokenize_sft_rows
from trainers.errors import DataError
from trainers.loop import LossSums, TrainingTask, run_training
from trainers.losses import token_cross_entropy
from trainers.modeling import PRECISIONS, load_model, load_tokenizer, pick_device
from trainers.rng import seed_everything
from trainers.schedule import SCHEDULES


@dataclass
class SFTConfig:
    """Configuration of an SFT run.

    Model:
        model_path: a local Hugging Face folder (or a hub id where the host is online).
        output_dir: local folder that receives ``checkpoint-{step:06d}/`` folders.
        use_lora: train a LoRA adapter (merged into the base for the final checkpoint) instead of all
            weights.
        lora_r, lora_alpha, lora_dropout: LoRA rank, scaling numerator (scale = alpha / r) and dropout.
        lora_target_modules: module names to adapt; None adapts every linear layer but the LM head.
        gradient_checkpointing: recompute activations in the backward pass to save memory.

    Data:
        max_length: examples are truncated to this many tokens; those left with no target are dropped.
        packing: concatenate each micro-batch into one row without padding (position ids restart per
            example, so examples do not attend to each other). Same loss as padded batches.

    Optimisation:
        n_epochs: passes over the training rows.
        batch_size: examples per forward pass (micro-batch).
        gradient_accumulation_steps: micro-batches per optimizer step; an optimizer step sees
            ``batch_size * gradient_accumulation_steps`` examples (fewer at the end of an epoch).
        learning_rate: peak AdamW learning rate.
        lr_scheduler: ``linear`` | ``cosine`` (decay to 0) | ``constant``, after linear warmup.
        warmup_ratio: fraction of the optimizer steps spent warming up from 0.
        weight_decay: AdamW decoupled weight decay, on matrices only.
        max_grad_norm: clip the global gradient norm to this (<= 0: no clipping).
        mixed_precision: ``auto`` (bf16 on CUDA if supported, else none) | ``no`` | ``bf16`` | ``fp16``;
            CPU always trains in plain fp32.
        seed: seeds LoRA initialisation, dropout and the data order.
        max_steps: cap on the number of optimizer steps (None: ``n_epochs`` full epochs).

    Method and run control:
        save_steps: write a resumable checkpoint every N optimizer steps; 0 writes only the final one.
        eval_steps: compute ``valid_loss`` every N steps when validation rows are given; 0 does it at the
            end of each epoch (and always after the last step).
        resume_from: a checkpoint folder written by this library; training continues from it exactly.
    """

    model_path: str
    output_dir: str
    use_lora: bool = True
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None
    max_length: int = 1024
    packing: bool = False
    n_epochs: int = 1
    batch_size: int = 4
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2e-4
    lr_scheduler: str = "linear"
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    mixed_precision: str = "auto"
    gradient_checkpointing: bool = False
    seed: int = 42
    max_steps: int | None = None
    save_steps: int = 0
    eval_steps: int = 0
    resume_from: str | None = None

    def validate(self) -> None:
        """Raise ``DataError`` naming the first hyperparameter out of range."""
        checks = {
            "lora_r": self.lora_r >= 1,
            "max_length": self.max_length >= 2,
            "n_epochs": self.n_epochs >= 1,
            "batch_size": self.batch_size >= 1,
            "gradient_accumulation_steps": self.gradient_accumulation_steps >= 1,
            "learning_rate": self.learning_rate > 0,
            "lr_scheduler": self.lr_scheduler in SCHEDULES,
            "warmup_ratio": 0.0 <= self.warmup_ratio <= 1.0,
            "weight_decay": self.weight_decay >= 0,
            "mixed_precision": self.mixed_precision in PRECISIONS,
            "max_steps": self.max_steps is None or self.max_steps >= 1,
            "save_steps": self.save_steps >= 0,
            "eval_steps": self.eval_steps >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise DataError(
                    f"{name}={getattr(self, name)!r} is out of range", param=f"hyperparameters.{name}"
                )


def sft_loss(model: torch.nn.Module, batch: SFTBatch) -> LossSums:
    """Summed target-token cross-entropy and correct-token count of one micro-batch."""
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,  # also required for packing: with a cache, transformers ignores packed position ids
    ).logits
    sums = token_cross_entropy(logits, batch.labels)
    return LossSums(loss=sums.loss_sum, metrics={"mean_token_accuracy": float(sums.n_correct)})


def train_sft(
    config: SFTConfig,
    train_rows: Sequence[Mapping[str, Any]],
    valid_rows: Sequence[Mapping[str, Any]] | None = None,
    callbacks: TrainingCallbacks | None = None,
) -> TrainResult:
    """Fine-tune ``config.model_path`` on ``train_rows``; raise ``DataError`` when the data is at fault."""
    config.validate()
    seed_everything(config.seed)
    tokenizer = load_tokenizer(config.model_path)
    train = tokenize_sft_rows(train_rows, tokenizer, max_length=config.max_length, param="training_file")
    valid = (
        tokenize_sft_rows(valid_rows, tokenizer, max_length=config.max_length, param="validation_file")
        if valid_rows
        else None
    )
    pad_id = tokenizer.pad_token_id
    assert isinstance(pad_id, int)
    collate = partial(pack_batch if config.packing else pad_batch, pad_token_id=pad_id)
    model = load_model(config, pick_device())
    task = TrainingTask(model, tokenizer, train, collate, sft_loss, valid)
    return run_training(config, task, callbacks)
