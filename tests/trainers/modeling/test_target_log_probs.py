"""modeling.target_log_probs: the log-probabilities of target tokens, with the LM head applied in chunks
after the decoder (the architectures it knows) or by the model itself (any other), and the same numbers
and gradients either way; pairs.pair_forward built on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from tests.trainers.methods.test_dpo import separable_rows
from trainers.data.preference import PreferenceBatch, collate_preferences, tokenize_preference_rows
from trainers.families.pairs import pair_forward
from trainers.losses import causal_lm as losses
from trainers.losses.causal_lm import IGNORE_INDEX, token_cross_entropy
from trainers.modeling import loading as modeling
from trainers.modeling.loading import row_sums, target_log_probs


def _batch(tokenizer: PreTrainedTokenizerBase) -> PreferenceBatch:
    examples = tokenize_preference_rows(separable_rows(3), tokenizer, max_length=64)
    return collate_preferences(list(examples), pad_token_id=tokenizer.pad_token_id)


def _reference(model: torch.nn.Module, batch: PreferenceBatch, mask: torch.Tensor) -> torch.Tensor:
    """Log-softmax of the whole [N, T, V] logits, read at each target, row by row."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    log_probs = logits.log_softmax(dim=-1)
    return torch.stack(
        [
            log_probs[i, t - 1, batch.input_ids[i, t]]
            for i in range(mask.shape[0])
            for t in range(1, mask.shape[1])
            if mask[i, t]
        ]
    )


@pytest.mark.parametrize("head", ["chunked", "whole_model"])
def test_target_log_probs_and_their_gradients(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch, head: str
) -> None:
    if head == "chunked":
        monkeypatch.setattr(losses, "CHUNK_ELEMENTS", 5 * 512)  # 5 rows a chunk of the tiny vocabulary
    else:
        monkeypatch.setattr(modeling, "PLAIN_HEAD_MODELS", frozenset())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    batch = _batch(tokenizer)
    mask = batch.completion_mask.bool()
    weights = torch.linspace(0.5, 2.0, int(mask[:, 1:].sum()))  # a different upstream gradient per token

    expected = _reference(model, batch, mask)
    (expected * weights).sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    ours = target_log_probs(model, batch.input_ids, batch.attention_mask, mask)
    (ours * weights).sum().backward()
    assert ours.dtype == torch.float32
    assert torch.allclose(ours, expected, atol=1e-5)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, expected_grads[name], atol=1e-5), name

    ours = ours.detach()
    per_row = row_sums(ours, mask)
    counts = mask[:, 1:].sum(dim=1).tolist()
    starts = [sum(counts[:i]) for i in range(len(counts))]
    assert per_row.tolist() == pytest.approx(
        [float(ours[s : s + c].sum()) for s, c in zip(starts, counts, strict=True)], rel=1e-6
    )


@pytest.mark.parametrize("nll_on_prompt", [False, True])
def test_pair_forward_equals_the_whole_logits_computation(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase, nll_on_prompt: bool
) -> None:
    """Completion log-probs per row, lengths, and the chosen rows' mean NLL (over their completions, or
    every token but the first), as computed from the whole logits."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    batch = _batch(tokenizer)
    out = pair_forward(model, batch, nll_on_prompt=nll_on_prompt)

    mask = batch.completion_mask.bool()
    expected_logps = row_sums(_reference(model, batch, mask), mask)
    n = batch.n_pairs
    targets = batch.attention_mask[:n].bool() if nll_on_prompt else mask[:n]
    logits = model(input_ids=batch.input_ids[:n], attention_mask=batch.attention_mask[:n]).logits
    nll = token_cross_entropy(logits, torch.where(targets, batch.input_ids[:n], IGNORE_INDEX))
    assert torch.allclose(out.logps, expected_logps, atol=1e-5)
    assert out.lengths.tolist() == mask[:, 1:].sum(dim=1).float().tolist()
    assert out.chosen_nll.item() == pytest.approx(nll.loss_sum.item() / nll.n_tokens, rel=1e-6)
    assert out.chosen_nll.requires_grad
    assert not pair_forward(
        model, batch, nll_on_prompt=nll_on_prompt, nll_grad=False
    ).chosen_nll.requires_grad
