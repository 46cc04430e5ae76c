"""Padding-free packing: packed examples do not see each other, so losses equal the padded batch's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from tests.trainers.helpers import Recorder
from trainers.data.collate import SFTBatch, pack_batch, pad_batch
from trainers.data.packing import best_fit_decreasing
from trainers.data.sft import TokenizedExample, tokenize_sft_rows
from trainers.losses import causal_lm as losses
from trainers.losses.causal_lm import IGNORE_INDEX, target_positions, token_cross_entropy
from trainers.methods import sft
from trainers.methods.sft import SFTConfig, sft_loss, train_sft
from trainers.modeling import loading as modeling


def per_example_packed_losses(
    model: torch.nn.Module,
    batch: SFTBatch,
    bins: list[list[int]],
    lengths: list[int],
    position_ids: torch.Tensor,
) -> dict[int, float]:
    """Each example's summed loss, read from the packed rows' logits where ``bins`` placed it."""
    # As in `sft_loss`: with a KV cache, transformers would skip the packed-sequence mask.
    logits = model(input_ids=batch.input_ids, position_ids=position_ids, use_cache=False).logits
    losses = {}
    for row, members in enumerate(bins):
        start = 0
        for index in members:
            end = start + lengths[index]
            sums = token_cross_entropy(
                logits[row : row + 1, start:end], batch.labels[row : row + 1, start:end]
            )
            losses[index] = sums.loss_sum.item()
            start = end
    return losses


def test_best_fit_decreasing_fills_the_fullest_row_that_fits() -> None:
    # longest first: 6 opens row 0 (2 free), 5 opens row 1 (3 free), 4 opens row 2 (4 free); 3 goes to the
    # fullest row it fits (row 1, not row 2), 2 to row 0 (2 free, the fullest), 1 to row 2 (4 free).
    assert best_fit_decreasing([3, 6, 1, 5, 2, 4], capacity=8) == [[1, 4], [3, 0], [5, 2]]
    # an example longer than a row gets a row of its own; equal lengths keep their order
    assert best_fit_decreasing([9, 2, 2], capacity=4) == [[0], [1, 2]]


@torch.no_grad()
def test_packed_equals_padded(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase, demo_rows: list[dict[str, Any]]
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    examples = tokenize_sft_rows(demo_rows[:6], tokenizer, max_length=1024)
    lengths = [len(e.input_ids) for e in examples]
    alone = [
        token_cross_entropy(
            model(input_ids=pad_batch([e], pad_token_id=0).input_ids).logits,
            pad_batch([e], pad_token_id=0).labels,
        ).loss_sum.item()
        for e in examples
    ]
    # rows of about a third of the total: several rows, several examples per row, padded tails
    max_length = max(*lengths, sum(lengths) // 3)
    bins = best_fit_decreasing(lengths, max_length)
    assert 1 < len(bins) < len(examples)
    packed_batch = pack_batch(examples, pad_token_id=tokenizer.pad_token_id, max_length=max_length)
    assert packed_batch.input_ids.shape == (len(bins), max(sum(lengths[i] for i in b) for b in bins))
    assert packed_batch.position_ids is not None
    packed = per_example_packed_losses(model, packed_batch, bins, lengths, packed_batch.position_ids)
    assert [packed[i] for i in range(len(examples))] == pytest.approx(alone, abs=1e-5)

    padded_batch = pad_batch(examples, pad_token_id=tokenizer.pad_token_id)
    assert packed_batch.n_targets == padded_batch.n_targets
    assert packed_batch.n_inputs == padded_batch.n_inputs == sum(lengths)
    packed_loss = sft_loss(model, packed_batch).loss.item() / packed_batch.n_targets
    padded_loss = sft_loss(model, padded_batch).loss.item() / padded_batch.n_targets
    assert packed_loss == pytest.approx(padded_loss, abs=1e-5)

    # Control: with positions running on along each row, examples attend to each other and the losses move.
    running = torch.arange(packed_batch.input_ids.shape[1]).expand_as(packed_batch.input_ids)
    leaky = per_example_packed_losses(model, packed_batch, bins, lengths, running)
    firsts = {b[0] for b in bins}
    assert all(leaky[i] == pytest.approx(alone[i], abs=1e-5) for i in firsts)
    assert max(abs(leaky[i] - alone[i]) for i in range(len(examples)) if i not in firsts) > 1e-3


@pytest.mark.parametrize("head", ["chunked", "whole_model"])
@pytest.mark.parametrize("packing", [False, True])
def test_loss_at_target_positions_equals_the_full_logits_loss(
    tiny_model_path: Path,
    tokenizer: PreTrainedTokenizerBase,
    demo_rows: list[dict[str, Any]],
    packing: bool,
    head: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``sft_loss`` runs the LM head at target positions only: same loss, gradients and accuracy as the
    cross-entropy of the full [B, T, V] logits, whether the head is applied in chunks after the decoder
    (here 7 rows a chunk, so that a batch spans many) or by the model itself (an architecture the chunked
    path does not know)."""
    if head == "chunked":
        monkeypatch.setattr(losses, "CHUNK_ELEMENTS", 7 * 512)  # the tiny vocabulary has 512 tokens
    else:
        monkeypatch.setattr(modeling, "PLAIN_HEAD_MODELS", frozenset())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert (modeling.decoder_and_head(model) is None) == (head == "whole_model")
    examples = tokenize_sft_rows(demo_rows[:6], tokenizer, max_length=1024)
    pad_id = tokenizer.pad_token_id
    batch = (
        pack_batch(examples, pad_token_id=pad_id, max_length=300)
        if packing
        else pad_batch(examples, pad_token_id=pad_id)
    )
    keep = target_positions(batch.labels)
    assert 0 < len(keep) < batch.input_ids.shape[1] - 1  # the prompts' logits are really skipped

    full_logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).logits
    full = token_cross_entropy(full_logits, batch.labels)
    (full.loss_sum / batch.n_targets).backward()  # as the loop does: the upstream gradient is not 1
    full_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    sliced = sft_loss(model, batch)
    (sliced.loss / batch.n_targets).backward()
    assert sliced.loss.item() == pytest.approx(full.loss_sum.item(), rel=1e-6)
    assert float(sliced.metrics["mean_token_accuracy"]) == float(full.n_correct)
    # the head's gradient, and through the hidden states' gradient every layer's below it
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, full_grads[name], atol=1e-6), name


@pytest.mark.parametrize("packing", [True, False], ids=["rows_of_max_length", "rows_of_the_longest"])
def test_packed_training_matches_padded_training(
    make_config: Callable[..., SFTConfig],
    demo_rows: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    packing: bool,
) -> None:
    """``packing: true`` packs into rows of ``max_length``; without it the tiny Llama (a decoder that runs
    alone) is still packed, into rows of the micro-batch's longest example. Both train as padded rows."""
    base = str(Path(make_config().output_dir).parent)
    padded, packed = Recorder(), Recorder()
    capacities: list[int | None] = []

    def spy(examples: Any, *, pad_token_id: int, max_length: int | None) -> SFTBatch:
        capacities.append(max_length)
        return pack_batch(examples, pad_token_id=pad_token_id, max_length=max_length)

    monkeypatch.setattr(sft, "pack_batch", spy)
    # max_length 160: several rows per packed micro-batch (and the longest demo rows truncated, alike)
    run = {"use_lora": False, "learning_rate": 1e-3, "max_steps": 4, "max_length": 160}
    config = make_config(**run, packing=packing, output_dir=f"{base}/packed")
    train_sft(config, demo_rows, demo_rows[:8], packed)
    assert capacities and set(capacities) == {160 if packing else None}
    monkeypatch.setattr(sft, "runs_packed", lambda model: False)  # right-padded rows, an attention mask
    capacities.clear()
    train_sft(make_config(**run, output_dir=f"{base}/padded"), demo_rows, demo_rows[:8], padded)
    assert not capacities
    assert packed.losses == pytest.approx(padded.losses, abs=1e-5)
    assert packed.evals[-1]["valid_loss"] == pytest.approx(padded.evals[-1]["valid_loss"], abs=1e-5)
    assert [r["trained_tokens"] for r in packed.steps] == [r["trained_tokens"] for r in padded.steps]


def _hand_built() -> list[TokenizedExample]:
    # every token marked trainable: only the first of each example must lose its target
    return [TokenizedExample([5, 6, 7, 8], [True] * 4), TokenizedExample([9, 10], [False, True])]


@pytest.mark.parametrize("collate", ["pad", "pack"])
def test_first_token_has_no_target_and_tensors_are_integer(collate: str) -> None:
    examples = _hand_built()
    if collate == "pad":
        batch = pad_batch(examples, pad_token_id=0)
        rows = [batch.labels[0].tolist(), batch.labels[1].tolist()]
        assert rows == [[IGNORE_INDEX, 6, 7, 8], [IGNORE_INDEX, 10, IGNORE_INDEX, IGNORE_INDEX]]
        assert batch.attention_mask is not None and batch.attention_mask.dtype == torch.long
        assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    else:
        batch = pack_batch(examples, pad_token_id=0, max_length=8)
        assert batch.labels.tolist() == [[IGNORE_INDEX, 6, 7, 8, IGNORE_INDEX, 10]]
        assert batch.position_ids is not None
        assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1]]
        assert batch.position_ids.dtype == torch.long  # models index embeddings with them
    assert batch.n_targets == 4
    assert batch.input_ids.dtype == batch.labels.dtype == torch.long


def test_mismatched_mask_is_refused() -> None:
    with pytest.raises(ValueError):
        pad_batch([TokenizedExample([1, 2, 3], [True, True])], pad_token_id=0)


@pytest.mark.parametrize("collate", ["pad", "pack"])
def test_to_moves_every_tensor_and_keeps_the_rest(collate: str) -> None:
    examples = _hand_built()
    batch = (
        pad_batch(examples, pad_token_id=0)
        if collate == "pad"
        else pack_batch(examples, pad_token_id=0, max_length=8)
    )
    moved = batch.to(torch.device("meta"))  # a device tensors visibly change to, without a GPU
    tensors = ("input_ids", "labels", "attention_mask", "position_ids", "logit_positions")
    for name in tensors:
        before, after = getattr(batch, name), getattr(moved, name)
        assert (before is None) == (after is None), name
        if before is not None:
            assert after.device.type == "meta" and after.shape == before.shape, name
    assert (moved.n_targets, moved.n_inputs) == (batch.n_targets, batch.n_inputs)
