"""Padding-free packing: packed examples do not see each other, so losses equal the padded batch's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from tests.trainers.helpers import Recorder
from trainers.collate import pack_batch, pad_batch
from trainers.data import TokenizedExample, tokenize_sft_rows
from trainers.losses import token_cross_entropy
from trainers.sft import SFTConfig, sft_loss, train_sft


def per_example_packed_losses(
    model: torch.nn.Module, examples: list[TokenizedExample], position_ids: torch.Tensor
) -> list[float]:
    batch = pack_batch(examples, pad_token_id=0)
    # As in `sft_loss`: with a KV cache, transformers would skip the packed-sequence mask.
    logits = model(input_ids=batch.input_ids, position_ids=position_ids, use_cache=False).logits
    losses, start = [], 0
    for example in examples:
        end = start + len(example.input_ids)
        losses.append(token_cross_entropy(logits[:, start:end], batch.labels[:, start:end]).loss_sum.item())
        start = end
    return losses


@torch.no_grad()
def test_packed_equals_padded(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase, demo_rows: list[dict[str, Any]]
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    examples = tokenize_sft_rows(demo_rows[:6], tokenizer, max_length=1024)
    alone = [
        token_cross_entropy(
            model(input_ids=pad_batch([e], pad_token_id=0).input_ids).logits,
            pad_batch([e], pad_token_id=0).labels,
        ).loss_sum.item()
        for e in examples
    ]
    packed_batch = pack_batch(examples, pad_token_id=0)
    packed = per_example_packed_losses(model, examples, packed_batch.position_ids)
    assert packed == pytest.approx(alone, abs=1e-5)

    padded_batch = pad_batch(examples, pad_token_id=tokenizer.pad_token_id)
    assert packed_batch.n_targets == padded_batch.n_targets
    assert packed_batch.n_inputs == padded_batch.n_inputs
    packed_loss = sft_loss(model, packed_batch).loss.item() / packed_batch.n_targets
    padded_loss = sft_loss(model, padded_batch).loss.item() / padded_batch.n_targets
    assert packed_loss == pytest.approx(padded_loss, abs=1e-5)

    # Control: with positions running on across examples, they attend to each other and the losses move.
    running = torch.arange(packed_batch.input_ids.shape[1]).unsqueeze(0)
    leaky = per_example_packed_losses(model, examples, running)
    assert leaky[0] == pytest.approx(alone[0], abs=1e-5)
    assert max(abs(a - b) for a, b in zip(leaky[1:], alone[1:], strict=True)) > 1e-3


def test_packed_training_matches_padded_training(
    make_config: Callable[..., SFTConfig], demo_rows: list[dict[str, Any]]
) -> None:
    base = str(Path(make_config().output_dir).parent)
    padded, packed = Recorder(), Recorder()
    config = make_config(use_lora=False, learning_rate=1e-3, max_steps=4, output_dir=f"{base}/padded")
    train_sft(config, demo_rows, demo_rows[:8], padded)
    config = make_config(
        use_lora=False, learning_rate=1e-3, max_steps=4, packing=True, output_dir=f"{base}/packed"
    )
    train_sft(config, demo_rows, demo_rows[:8], packed)
    assert packed.losses == pytest.approx(padded.losses, abs=1e-5)
    assert packed.evals[-1]["valid_loss"] == pytest.approx(padded.evals[-1]["valid_loss"], abs=1e-5)
    assert [r["trained_tokens"] for r in packed.steps] == [r["trained_tokens"] for r in padded.steps]
