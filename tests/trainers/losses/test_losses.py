"""The SFT loss equals a hand-written reference and TRL's SFTTrainer loss on the same batch."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
import torch.nn.functional as F
import trl
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from trainers.data.collate import SFTBatch, pad_batch
from trainers.data.sft import tokenize_sft_rows
from trainers.losses.causal_lm import (
    IGNORE_INDEX,
    linear_cross_entropy,
    linear_token_nll,
    target_positions,
    token_cross_entropy,
)
from trainers.methods.sft import sft_loss


def load(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def test_sft_loss_equals_reference(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase, demo_rows: list[dict[str, Any]]
) -> None:
    examples = tokenize_sft_rows(demo_rows[:4], tokenizer, max_length=1024)
    model = load(tiny_model_path)
    batch = pad_batch(examples, pad_token_id=tokenizer.pad_token_id)
    sums = sft_loss(model, batch)
    ours = sums.loss.item() / batch.n_targets

    # Reference: each example alone, no padding, -log softmax summed over its masked positions.
    total, count, correct = 0.0, 0, 0
    for example in examples:
        logits = model(input_ids=torch.tensor([example.input_ids])).logits[0]
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        for t in range(1, len(example.input_ids)):
            if example.loss_mask[t]:
                total -= log_probs[t - 1, example.input_ids[t]].item()
                count += 1
                correct += int(logits[t - 1].argmax().item() == example.input_ids[t])
    assert count == batch.n_targets
    assert ours == pytest.approx(total / count, abs=1e-5)
    assert sums.metrics["mean_token_accuracy"] == correct


PROMPTS = [
    {"prompt": "Q: What is the capital of France?\nA:", "completion": " The capital of France is Paris."},
    {"prompt": "Q: What is the capital of Peru?\nA:", "completion": " Lima."},
    {"prompt": "Q: Name the capital city of Japan.\nA:", "completion": " Tokyo is."},
    {"prompt": "Tell me more.", "completion": " The robot learned about rivers and mountains."},
]


# TRL sets `gradient_checkpointing`, which transformers 5 deprecates (for `activation_checkpointing`).
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_sft_loss_equals_trl(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    datasets.disable_progress_bars()
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        completion_only_loss=True,
        per_device_train_batch_size=len(PROMPTS),
        max_length=64,
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    trainer = trl.SFTTrainer(
        model=load(tiny_model_path),
        args=args,
        train_dataset=datasets.Dataset.from_list(PROMPTS),
        processing_class=tokenizer,
    )
    trl_batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        trl_loss = trainer.compute_loss(trainer.model, dict(trl_batch)).item()

    # Same ids and targets as our own tokenization of the rows (the sampler may reorder them).
    ours = tokenize_sft_rows(PROMPTS, tokenizer, max_length=64)
    trl_rows = set()
    for ids, labels, mask in zip(
        trl_batch["input_ids"], trl_batch["labels"], trl_batch["attention_mask"], strict=True
    ):
        n = int(mask.sum())
        trl_rows.add((tuple(ids[:n].tolist()), tuple((labels[:n] != IGNORE_INDEX).tolist())))
    assert trl_rows == {(tuple(e.input_ids), tuple(e.loss_mask)) for e in ours}

    batch = SFTBatch(
        input_ids=trl_batch["input_ids"],
        labels=trl_batch["labels"],
        attention_mask=trl_batch["attention_mask"],
        position_ids=None,
        n_targets=int((trl_batch["labels"][:, 1:] != IGNORE_INDEX).sum()),
        n_inputs=int(trl_batch["attention_mask"].sum()),
        logit_positions=target_positions(trl_batch["labels"]),
    )
    with torch.no_grad():
        our_loss = sft_loss(load(tiny_model_path), batch).loss.item() / batch.n_targets
    assert math.isfinite(our_loss)
    assert our_loss == pytest.approx(trl_loss, abs=1e-5)


def test_token_cross_entropy_shifts_labels_by_one() -> None:
    """The unshifted-labels entry point (ORPO's NLL term uses it) against a per-token loop: the logits at
    position t - 1 are scored against the label at t; IGNORE_INDEX positions count nowhere."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=generator)
    labels = torch.tensor([[3, 1, IGNORE_INDEX, 6, 0], [IGNORE_INDEX, IGNORE_INDEX, 2, 2, IGNORE_INDEX]])
    sums = token_cross_entropy(logits, labels)
    expected, count, correct = 0.0, 0, 0
    for row in range(2):
        log_probs = torch.log_softmax(logits[row].double(), dim=-1)
        for t in range(1, 5):
            target = int(labels[row, t])
            if target != IGNORE_INDEX:
                expected -= float(log_probs[t - 1, target])
                count += 1
                correct += int(int(logits[row, t - 1].argmax()) == target)
    assert sums.n_tokens == count == 5  # labels[:, 0] is never a target: nothing predicts it
    assert sums.loss_sum.item() == pytest.approx(expected, abs=1e-5)
    assert int(sums.n_correct) == correct


@pytest.mark.parametrize("chunk_rows", [3, 10, None])
def test_linear_cross_entropy_equals_the_cross_entropy_of_the_whole_logits(chunk_rows: int | None) -> None:
    """The chunked head + loss gives the loss, accuracy count and gradients of ``hidden @ weight.T`` fed
    to cross-entropy whole: over uneven chunks (3 rows of 10), one chunk, and the default size."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 16, generator=generator, requires_grad=True)
    weight = torch.randn(40, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 40, (10,), generator=generator)
    targets[:4] = (hidden[:4] @ weight.T).argmax(dim=-1)  # some right answers to count

    logits = hidden @ weight.T
    expected = F.cross_entropy(logits, targets, reduction="sum")
    (expected * 0.37).backward()  # an upstream gradient other than 1, as the loop's normalisation gives
    expected_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None

    sums = linear_cross_entropy(hidden, weight, targets, chunk_rows=chunk_rows)
    (sums.loss_sum * 0.37).backward()
    assert sums.loss_sum.item() == pytest.approx(expected.item(), rel=1e-6)
    assert int(sums.n_correct) == int((logits.argmax(dim=-1) == targets).sum()) >= 4
    assert sums.n_tokens == 10
    assert torch.allclose(hidden.grad, expected_grads[0], atol=1e-6)
    assert torch.allclose(weight.grad, expected_grads[1], atol=1e-6)


@pytest.mark.parametrize("chunk_rows", [3, None])
def test_a_frozen_heads_hidden_gradient_is_taken_in_forward_and_scaled_per_row(
    chunk_rows: int | None,
) -> None:
    """With the head frozen (LoRA), forward takes the hidden states' gradient and backward scales each
    row by its own upstream gradient: per-row weights (as DPO's per-sequence sums give) must reach the
    right rows, over uneven chunks and one chunk."""
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(10, 16, generator=generator, requires_grad=True)
    weight = torch.randn(40, 16, generator=generator)
    targets = torch.randint(0, 40, (10,), generator=generator)
    row_weights = torch.randn(10, generator=generator)

    expected = F.cross_entropy(hidden @ weight.T, targets, reduction="none")
    (expected * row_weights).sum().backward()
    expected_grad, hidden.grad = hidden.grad.clone(), None
    nll, _ = linear_token_nll(hidden, weight, targets, chunk_rows=chunk_rows)
    (nll * row_weights).sum().backward()
    assert torch.allclose(nll, expected.detach(), atol=1e-6)
    assert torch.allclose(hidden.grad, expected_grad, atol=1e-6)


def test_linear_cross_entropy_with_a_frozen_head_under_autocast() -> None:
    """LoRA freezes the head: only the hidden states get a gradient. Under bf16 autocast the head's
    products run in bf16, as the whole-model path's ``lm_head`` would, and the loss is taken in float32
    from those logits; the float32 head's loss is measurably different (the control)."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 8, generator=generator, requires_grad=True)
    weight = torch.randn(20, 8, generator=generator)
    targets = torch.randint(0, 20, (6,), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = hidden @ weight.T
    assert logits.dtype == torch.bfloat16
    expected = F.cross_entropy(logits.float(), targets, reduction="sum")
    expected.backward()
    expected_grad, hidden.grad = hidden.grad.clone(), None
    float32_loss = F.cross_entropy(hidden.detach() @ weight.T, targets, reduction="sum")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sums = linear_cross_entropy(hidden, weight, targets, chunk_rows=4)
    sums.loss_sum.backward()
    assert sums.loss_sum.dtype == torch.float32
    assert sums.loss_sum.item() == pytest.approx(expected.item(), rel=1e-6)
    assert sums.loss_sum.item() != pytest.approx(float32_loss.item(), rel=1e-4)
    assert torch.allclose(hidden.grad, expected_grad, rtol=2e-2, atol=1e-2)


def test_a_trained_head_under_autocast_over_uneven_chunks() -> None:
    """Full fine-tuning trains the head: under bf16 autocast its weight's gradient is summed over the
    chunks in float32 from bf16 products, each chunk reusing the last one's buffers (10 rows in chunks of
    4, 4 and 2): loss and both gradients as the whole logits' in bf16 give them."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(10, 8, generator=generator, requires_grad=True)
    weight = torch.randn(24, 8, generator=generator, requires_grad=True)
    targets = torch.randint(0, 24, (10,), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = hidden @ weight.T
    expected = F.cross_entropy(logits.float(), targets, reduction="sum")
    (expected * 0.37).backward()
    expected_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sums = linear_cross_entropy(hidden, weight, targets, chunk_rows=4)
    (sums.loss_sum * 0.37).backward()
    assert sums.loss_sum.item() == pytest.approx(expected.item(), rel=1e-6)
    assert weight.grad.dtype == torch.float32
    assert torch.allclose(hidden.grad, expected_grads[0], rtol=2e-2, atol=1e-2)
    assert torch.allclose(weight.grad, expected_grads[1], rtol=2e-2, atol=1e-2)
