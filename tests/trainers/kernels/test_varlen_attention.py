"""``trainers.kernels.varlen_attention``: packed sequences' attention from their bounds equals the
block-diagonal
masked attention transformers builds from their position ids.

The variable-length kernel is CUDA's only. On the CPU these tests run the module's CPU branch, which
computes the same thing sequence by sequence (``VARLEN_DEVICES`` gains "cpu"): the bounds, the token
layout, grouped-query heads and the plumbing through the decoder are what they check there. Where a GPU
is present, the ``cuda`` cases run the kernel itself (in bf16, which it needs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from tests.trainers.helpers import Recorder
from trainers.data.collate import pack_batch, pad_batch
from trainers.data.sft import tokenize_sft_rows
from trainers.kernels import varlen_attention
from trainers.methods.sft import SFTConfig, sft_loss, train_sft

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The module's attention in transformers' registry, taking its variable-length path on the CPU too."""
    monkeypatch.setattr(varlen_attention, "VARLEN_DEVICES", frozenset({"cpu", "cuda"}))
    varlen_attention.install()
    yield
    varlen_attention.uninstall()


@pytest.fixture
def varlen_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per call of the variable-length path (``segment_attention``), which still runs."""
    calls: list[int] = []
    segment_attention = varlen_attention.segment_attention

    def spy(*args: Any) -> torch.Tensor:
        calls.append(1)
        return segment_attention(*args)

    monkeypatch.setattr(varlen_attention, "segment_attention", spy)
    return calls


def test_sequence_starts_cover_every_packed_sequence_and_padded_tail() -> None:
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])  # row 0 ends in a 1-token tail
    starts, longest = varlen_attention.sequence_starts(position_ids)
    assert starts.tolist() == [0, 3, 5, 6, 10, 12]
    assert starts.dtype == torch.int32
    assert longest == 4


def _block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[R, 1, W, W]: a slot sees the slots of its own sequence up to itself."""
    sequence = (position_ids == 0).cumsum(dim=1)
    same = sequence[:, :, None] == sequence[:, None, :]
    causal = torch.ones(position_ids.shape[1], position_ids.shape[1], dtype=torch.bool).tril()
    return (same & causal)[:, None]


class _Attention(torch.nn.Module):
    """What transformers' attention functions read off a Llama attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("device", DEVICES)
def test_attention_from_bounds_equals_the_block_diagonal_mask(installed: None, device: str) -> None:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 0, 1, 2, 3, 0]])
    rows, width = position_ids.shape
    heads, kv_heads, dim = 4, 2, 16
    query = torch.randn(rows, heads, width, dim, device=device, dtype=dtype, requires_grad=True)
    key = torch.randn(rows, kv_heads, width, dim, device=device, dtype=dtype, requires_grad=True)
    value = torch.randn(rows, kv_heads, width, dim, device=device, dtype=dtype, requires_grad=True)
    module = _Attention(heads // kv_heads)
    scaling = 0.3  # not 1 / sqrt(dim): the scale must reach the kernel
    mask = _block_causal_mask(position_ids).to(device)
    expected, _ = varlen_attention.sdpa_attention_forward(module, query, key, value, mask, scaling=scaling)
    starts, longest = varlen_attention.sequence_starts(position_ids)
    bounds = varlen_attention.attention_kwargs(starts.to(device), longest)
    got, _ = varlen_attention.attention_forward(module, query, key, value, None, scaling=scaling, **bounds)
    assert got.shape == expected.shape == (rows, width, heads, dim)
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-5}
    torch.testing.assert_close(got, expected, **tolerance)

    upstream = torch.randn_like(got)
    grads = torch.autograd.grad(got, (query, key, value), upstream)
    expected_grads = torch.autograd.grad(expected, (query, key, value), upstream)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, **tolerance)


def test_without_bounds_it_is_transformers_sdpa(installed: None) -> None:
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, 2, 5, 8) for _ in range(3))
    module = _Attention(1)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    got, _ = varlen_attention.attention_forward(module, query, key, value, mask)
    expected, _ = varlen_attention.sdpa_attention_forward(module, query, key, value, mask)
    assert torch.equal(got, expected)


def test_a_packed_batch_passes_its_bounds_only_where_they_are_read(
    tokenizer: PreTrainedTokenizerBase, demo_rows: list[dict[str, Any]]
) -> None:
    examples = tokenize_sft_rows(demo_rows[:6], tokenizer, max_length=1024)
    packed = pack_batch(examples, pad_token_id=tokenizer.pad_token_id, max_length=300)
    assert packed.sequence_starts is not None and packed.longest_sequence > 0
    assert not varlen_attention.installed() and packed.attention_kwargs() == {}
    varlen_attention.install()
    try:
        assert packed.attention_kwargs()["cu_seq_lens_q"] is packed.sequence_starts
        assert pad_batch(examples, pad_token_id=tokenizer.pad_token_id).attention_kwargs() == {}
    finally:
        varlen_attention.uninstall()
    assert not varlen_attention.installed()


def test_the_decoder_hands_every_layer_the_bounds(
    installed: None,
    tiny_model_path: Path,
    tokenizer: PreTrainedTokenizerBase,
    demo_rows: list[dict[str, Any]],
    varlen_calls: list[int],
) -> None:
    """``sft_loss`` on a packed batch: every layer takes the variable-length path, and loss and gradients
    equal those of the block-diagonal mask transformers builds (``uninstall``: its own sdpa)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    examples = tokenize_sft_rows(demo_rows[:6], tokenizer, max_length=1024)
    lengths = [len(e.input_ids) for e in examples]
    batch = pack_batch(
        examples, pad_token_id=tokenizer.pad_token_id, max_length=max(*lengths, sum(lengths) // 3)
    )
    assert batch.input_ids.shape[0] > 1  # several rows, several sequences per row
    loss = sft_loss(model, batch).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert len(varlen_calls) == model.config.num_hidden_layers
    model.zero_grad()

    varlen_attention.uninstall()
    expected = sft_loss(model, batch).loss
    expected.backward()
    assert len(varlen_calls) == model.config.num_hidden_layers  # not called again
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            grads[name], p.grad, atol=1e-5, rtol=1e-5, msg=name
        )  # a summed loss: grads up to ~20


def test_a_packed_run_with_bounds_trains_as_a_padded_one(
    installed: None,
    make_config: Callable[..., SFTConfig],
    demo_rows: list[dict[str, Any]],
    varlen_calls: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the whole trainer (its decoder layers that keep less for backward included)."""
    from trainers.methods import sft

    base = str(Path(make_config().output_dir).parent)
    packed, padded = Recorder(), Recorder()
    run = {"use_lora": False, "learning_rate": 1e-3, "max_steps": 3, "max_length": 160, "packing": True}
    train_sft(make_config(**run, output_dir=f"{base}/packed"), demo_rows, None, packed)
    assert varlen_calls  # the packed run took the variable-length path
    varlen_calls.clear()
    monkeypatch.setattr(sft, "runs_packed", lambda model: False)
    train_sft(make_config(**{**run, "packing": False}, output_dir=f"{base}/padded"), demo_rows, None, padded)
    assert not varlen_calls
    assert len(packed.losses) == 3
    # on CUDA the trainer's default bf16 autocast rounds the two kernels' sums differently
    tolerance = {"rel": 1e-2} if torch.cuda.is_available() else {"abs": 1e-5}
    assert packed.losses == pytest.approx(padded.losses, **tolerance), (packed.losses, padded.losses)
