"""Training attention on a CPU in bf16 (trainers/cpu_attention.py): sdpa's outputs, and gradients as
close to a float32 reference as sdpa's own bf16 gradients, causal and under packed masks, with grouped
key/value heads, over several backward blocks; the calls it does not take go to sdpa."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.trainers.helpers import model_settings
from trainers import cpu_attention, varlen_attention
from trainers.modeling import computing_in, load_model
from trainers.precision import autocast_dtype


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(cpu_attention, "BLOCK_ROWS", 8)  # 21 rows: blocks of 8, 8 and 5
    yield
    varlen_attention.uninstall()  # load_model installs the CPU path; the other tests expect sdpa


def _inputs(
    batch: int = 2, heads: int = 6, kv_heads: int = 2, width: int = 21, dim: int = 16
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(batch, heads, width, dim), (batch, kv_heads, width, dim), (batch, kv_heads, width, dim)]
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _packed_mask(batch: int, width: int) -> torch.Tensor:
    """Row 0: sequences of 9 and 12 tokens; row 1: one of 16 and a padded tail of 5 (its own sequence)."""
    segments = torch.tensor([[0] * 9 + [1] * 12, [0] * 16 + [1] * 5])[:batch]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return (segments[:, :, None] == segments[:, None, :]) & causal  # [B, T, T]


def _attention_and_grads(
    attend: object, inputs: list[torch.Tensor], dtype: torch.dtype, upstream: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out = attend(*leaves)  # type: ignore[operator]
    (out.float() * upstream).sum().backward()
    return out.float(), [leaf.grad.float() for leaf in leaves]  # type: ignore[union-attr]


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "packed"])
def test_outputs_are_sdpas_and_gradients_as_close_to_float32_as_sdpas(masked: bool) -> None:
    inputs = _inputs()
    batch, heads, width, dim = inputs[0].shape
    mask = _packed_mask(batch, width)[:, None] if masked else None
    scale = dim**-0.5
    upstream = torch.randn(batch, heads, width, dim, generator=torch.Generator().manual_seed(1))

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )

    def blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = cpu_attention._BlockedAttention.apply(q, k, v, mask, scale)  # type: ignore[no-untyped-call]
        return out

    _, reference_grads = _attention_and_grads(sdpa, inputs, torch.float32, upstream)
    sdpa_out, sdpa_grads = _attention_and_grads(sdpa, inputs, torch.bfloat16, upstream)
    ours, grads = _attention_and_grads(blocked, inputs, torch.bfloat16, upstream)

    torch.testing.assert_close(ours, sdpa_out, rtol=0, atol=0)  # the same forward kernel
    for name, got, theirs, expected in zip("qkv", grads, sdpa_grads, reference_grads, strict=True):
        error, sdpa_error = (got - expected).abs().max(), (theirs - expected).abs().max()
        assert error <= 2 * sdpa_error + 1e-3, (name, float(error), float(sdpa_error))
        assert error < 0.02 * expected.abs().max(), name
    if masked:  # no gradient crosses from one packed sequence to another
        q, k, v = (t.detach().to(torch.bfloat16).requires_grad_() for t in inputs)
        blocked(q, k, v)[0, :, 12:].float().sum().backward()  # the second sequence's last queries
        assert k.grad is not None and float(k.grad[0, :, :9].abs().max()) == 0.0


def test_a_bf16_training_step_on_the_cpu_takes_it_and_an_fp32_one_does_not(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    forward = cpu_attention._BlockedAttention.forward

    def counted(ctx: object, query: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(query.shape[2])
        return forward(ctx, query, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_attention._BlockedAttention, "forward", staticmethod(counted))
    ids = torch.randint(3, 60, (2, 11), generator=torch.Generator().manual_seed(2))
    for precision, expected in (("bf16", 2), ("no", 0)):  # the tiny model's two layers, or none
        model = load_model(model_settings(tiny_model_path, mixed_precision=precision), torch.device("cpu"))
        assert cpu_attention.installed()
        with computing_in(model, autocast_dtype(precision, torch.device("cpu")), torch.device("cpu")):
            model(input_ids=ids, labels=ids).loss.backward()
            assert len(calls) == expected
            with torch.no_grad():  # generation and scoring without gradients: sdpa
                model(input_ids=ids)
            assert len(calls) == expected
        calls.clear()


def test_an_additive_mask_is_taken_as_the_boolean_it_encodes_and_a_bias_is_left_to_sdpa(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair methods hand attention an additive float mask (0 where a query attends, the dtype's
    minimum elsewhere): it runs as the boolean it encodes. A mask with other values is a bias: sdpa's."""
    calls: list[bool] = []
    forward = cpu_attention._BlockedAttention.forward

    def counted(ctx: object, *inputs: Any) -> torch.Tensor:
        mask = inputs[3]  # query, key, value, mask, ...
        calls.append(mask is not None and mask.dtype == torch.bool)
        return forward(ctx, *inputs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_attention._BlockedAttention, "forward", staticmethod(counted))
    q, k, v = (t.requires_grad_() for t in _inputs())
    batch, heads, width, dim = q.shape
    allowed = _packed_mask(batch, width)[:, None]
    additive = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.num_key_value_groups = heads // k.shape[1]  # what sdpa's path reads to repeat keys and values
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = cpu_attention.attention_forward(module, q, k, v, additive, scaling=dim**-0.5)
        expected = F.scaled_dot_product_attention(
            q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=allowed, scale=dim**-0.5, enable_gqa=True
        )
        assert calls == [True]
        torch.testing.assert_close(out, expected.transpose(1, 2), rtol=0, atol=0)
        bias = additive.clone()
        bias[..., 0] = -0.5  # every query's first key: attended, with a penalty
        cpu_attention.attention_forward(module, q, k, v, bias, scaling=dim**-0.5)
    assert calls == [True]


def test_a_mask_changed_in_place_is_converted_again() -> None:
    """Each layer of a forward gets the same mask tensor, whose conversion is kept; a tensor written to
    since (or another tensor) is converted anew."""
    q, k, v = (t.requires_grad_() for t in _inputs())
    batch, _, width, dim = q.shape
    module = torch.nn.Module()
    mask = _packed_mask(batch, width)[:, None].clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            out, _ = cpu_attention.attention_forward(module, q, k, v, mask, scaling=dim**-0.5)
            expected = F.scaled_dot_product_attention(
                q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=mask, scale=dim**-0.5, enable_gqa=True
            )
            torch.testing.assert_close(out, expected.transpose(1, 2), rtol=0, atol=0)
            mask[1] = torch.ones(width, width, dtype=torch.bool).tril()  # row 1: one sequence now
