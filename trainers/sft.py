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
from trainers.config import TrainingConfig
from trainers.data import tokenize_sft_rows
from trainers.loop import LossSums, TrainingTask, run_training
from trainers.losses import token_cross_entropy
from trainers.modeling import load_model, load_tokenizer, pick_device
from trainers.rng import seed_everything


@dataclass
class SFTConfig(TrainingConfig):
    """Configuration of an SFT run: the shared fields of ``trainers.config.TrainingConfig``, plus

    Data:
        max_length: examples are truncated to this many tokens; those left with no target are dropped.
        packing: concatenate each micro-batch into one row without padding (position ids restart per
            example, so examples do not attend to each other). Same loss as padded batches.
    """

    max_length: int = 1024
    packing: bool = False

    def _data_checks(self) -> dict[str, bool]:
        return {"max_length": self.max_length >= 2}


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
