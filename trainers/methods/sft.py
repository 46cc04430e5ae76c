"""Supervised fine-tuning (SFT): maximise the likelihood of the target tokens given their context.

    L(θ) = - (1 / |T|) Σ_{t ∈ T} log p_θ(x_t | x_<t)

where T is the set of target tokens of the step's accumulated batch: assistant turns of chat rows (those
with ``weight`` 1), completions of prompt/completion rows, every token of text rows. LoRA or full
fine-tuning, optional padding-free packing; the loop itself is ``trainers.core.loop``.

    python -c "
    import json
    from trainers.methods.sft import SFTConfig, train_sft; from trainers.modeling.tiny_model import *
    rows = [json.loads(line) for line in open(DEMO_SFT_PATH)]
    print(train_sft(SFTConfig(str(build_tiny_model('/tmp/tiny')), '/tmp/sft-out', max_steps=30), rows))"
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, ClassVar

import torch

from trainers.core.callbacks import TrainingCallbacks, TrainResult
from trainers.core.config import VisionConfig, knob
from trainers.core.errors import DataError
from trainers.core.loop import LossSums, TrainingTask, run_training
from trainers.data.collate import SFTBatch, pack_batch, pad_batch, pad_batch_with_inputs
from trainers.data.sft import TokenizedExample, tokenize_sft_rows
from trainers.families.entry import Rows, begin_on_rows, load_model_to_train, load_vision_data
from trainers.losses.causal_lm import IGNORE_INDEX, linear_cross_entropy, next_token_cross_entropy
from trainers.modeling.loading import decoder_and_head, pick_device, runs_packed

if TYPE_CHECKING:
    from trainers.rewards.reward_set import RewardSet


@dataclass
class SFTConfig(VisionConfig):
    """Configuration of an SFT run: ``TrainingConfig``'s fields plus the ``supervised`` entry's own
    hyperparameters (``trainers.registry``; docs/methods.md lists them with their docs and ranges).

    ``max_length`` truncates each example; one left with no target is dropped. ``packing`` bins a
    micro-batch's examples into rows of ``max_length`` tokens, position ids restarting per example: the
    same loss as padded batches. Without it, the architectures whose decoder runs alone
    (``modeling.runs_packed``) still pack, into rows no wider than the micro-batch's longest example:
    padding-free, with the attention width padding would have. Rows with images train on a vision base
    (``trainers.data.vision``), padded: packing is refused for them.
    """

    method: ClassVar[str] = "supervised"

    max_length: int = knob("supervised", "max_length")
    packing: bool = knob("supervised", "packing")


def sft_loss(model: torch.nn.Module, batch: SFTBatch) -> LossSums:
    """Summed target-token cross-entropy and correct-token count of one micro-batch.

    Only the positions that predict a target get logits: prompts and padding never reach the LM head.
    Where the model's logits are a plain ``hidden @ W.T`` (``modeling.decoder_and_head``), the decoder
    runs alone and ``losses.linear_cross_entropy`` applies the head chunk by chunk, so even the targets'
    [N, V] logits (the largest tensors of a small model's step) are never held at once; otherwise the
    model runs with ``logits_to_keep``.
    """
    keep = batch.logit_positions
    targets = batch.labels[:, keep + 1]
    inputs = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        "use_cache": False,  # also required for packing: with a cache, transformers ignores packed positions
        **batch.attention_kwargs(),  # packed: the sequences' bounds, for flash attention's varlen kernel
        **batch.extra_inputs,  # a vision model's pixels (trainers.data.vision)
    }
    split = decoder_and_head(model)
    if split is None:
        logits = model(**inputs, logits_to_keep=keep).logits
        sums = next_token_cross_entropy(logits, targets)
    else:
        decoder, head = split
        hidden = decoder(**inputs).last_hidden_state[:, keep]
        mask = targets != IGNORE_INDEX
        sums = linear_cross_entropy(hidden[mask], head.weight, targets[mask])
    return LossSums(loss=sums.loss_sum, metrics={"mean_token_accuracy": sums.n_correct})


def train_sft(
    config: SFTConfig,
    train_rows: Rows,
    valid_rows: Rows | None = None,
    callbacks: TrainingCallbacks | None = None,
    *,
    rewards: RewardSet | None = None,
) -> TrainResult:
    """Fine-tune ``config.model_path`` on ``train_rows``; raise ``DataError`` when the data is at fault."""
    vision = load_vision_data(config)
    tokenizer, train, valid = begin_on_rows(
        config,
        tokenize_sft_rows,
        train_rows,
        valid_rows,
        rewards=rewards,
        max_length=config.max_length,
        vision=vision,
    )
    pad_id = tokenizer.pad_token_id
    assert isinstance(pad_id, int)
    model = load_model_to_train(config, pick_device())
    collate: Callable[[Sequence[TokenizedExample]], SFTBatch] = partial(pad_batch, pad_token_id=pad_id)
    if vision is not None:
        if config.packing:
            raise DataError(
                "packing is not supported on a vision base (its rows' image positions are per row)",
                param="hyperparameters.packing",
            )
        collate = partial(pad_batch_with_inputs, pad_token_id=pad_id, inputs=vision)
    elif config.packing:
        collate = partial(pack_batch, pad_token_id=pad_id, max_length=config.max_length)
    elif runs_packed(model):
        collate = partial(pack_batch, pad_token_id=pad_id, max_length=None)
    saved = vision.processor if vision is not None else tokenizer  # what checkpoints hold beside the weights
    task = TrainingTask(model, saved, train, collate, sft_loss, valid)
    return run_training(config, task, callbacks)
