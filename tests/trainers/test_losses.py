"""The SFT loss equals a hand-written reference and TRL's SFTTrainer loss on the same batch."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
import trl
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from trainers.collate import SFTBatch, pad_batch
from trainers.data import tokenize_sft_rows
from trainers.losses import IGNORE_INDEX, target_positions, token_cross_entropy
from trainers.sft import sft_loss


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
