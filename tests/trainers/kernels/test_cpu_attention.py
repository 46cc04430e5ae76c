"""Training attention on a CPU (trainers/kernels/cpu_attention.py): sdpa's outputs; in bf16, gradients as
close
to a float32 reference as sdpa's own bf16 gradients, and in float32 sdpa's gradients, causal and under
packed masks, with grouped key/value heads, over several backward blocks; less kept for backward than
transformers' sdpa path keeps; the calls it does not take go to sdpa."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.trainers.helpers import model_settings
from trainers.core.precision import autocast_dtype, computing_in
from trainers.families.entry import load_model_to_train
from trainers.kernels import cpu_attention, varlen_attention
from trainers.kernels import install as kernel_install


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


def _packed_mask(batch: int, width: int, causal: bool = True) -> torch.Tensor:
    """Row 0: sequences of 9 and 12 tokens; row 1: one of 16 and a padded tail of 5 (its own sequence).
    Not ``causal``: each query sees its whole sequence, later keys too."""
    segments = torch.tensor([[0] * 9 + [1] * 12, [0] * 16 + [1] * 5])[:batch]
    order = torch.ones(width, width, dtype=torch.bool)
    return (segments[:, :, None] == segments[:, None, :]) & (order.tril() if causal else order)  # [B, T, T]


def _attention_and_grads(
    attend: object, inputs: list[torch.Tensor], dtype: torch.dtype, upstream: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out = attend(*leaves)  # type: ignore[operator]
    (out.float() * upstream).sum().backward()
    return out.float(), [leaf.grad.float() for leaf in leaves]  # type: ignore[union-attr]


@pytest.mark.parametrize("masking", ["causal", "packed", "packed both ways"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_outputs_are_sdpas_and_gradients_as_close_to_float32_as_sdpas(
    masking: str, dtype: torch.dtype
) -> None:
    inputs = _inputs()
    batch, heads, width, dim = inputs[0].shape
    masked = masking != "causal"
    mask = _packed_mask(batch, width, causal=masking == "packed")[:, None] if masked else None
    scale = dim**-0.5
    upstream = torch.randn(batch, heads, width, dim, generator=torch.Generator().manual_seed(1))

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = cpu_attention._FUNCTIONS[dtype].apply(q, k, v, mask, scale)  # type: ignore[no-untyped-call]
        assert out.is_contiguous()  # [B, T, H, D], as the output projection takes it
        return out.transpose(1, 2)

    _, reference_grads = _attention_and_grads(sdpa, inputs, torch.float32, upstream)
    sdpa_out, sdpa_grads = _attention_and_grads(sdpa, inputs, dtype, upstream)
    out, grads = _attention_and_grads(ours, inputs, dtype, upstream)

    torch.testing.assert_close(out, sdpa_out, rtol=0, atol=0)  # the same forward kernel
    for name, got, theirs, expected in zip("qkv", grads, sdpa_grads, reference_grads, strict=True):
        error, sdpa_error = (got - expected).abs().max(), (theirs - expected).abs().max()
        if dtype == torch.float32:  # the kernel's own backward
            torch.testing.assert_close(got, theirs, rtol=1e-5, atol=1e-5)
        assert error <= 2 * sdpa_error + 1e-3, (name, float(error), float(sdpa_error))
        assert error < 0.02 * expected.abs().max(), name
    if masked:  # no gradient crosses from one packed sequence to another
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in inputs)
        ours(q, k, v)[0, :, 12:].float().sum().backward()  # the second sequence's last queries
        assert k.grad is not None and float(k.grad[0, :, :9].abs().max()) == 0.0


def test_a_training_step_on_the_cpu_takes_the_function_of_its_dtype_and_a_step_without_gradients_sdpa(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    for function in cpu_attention._FUNCTIONS.values():

        def counted(ctx: object, *inputs: Any, forward: Any = function.forward) -> torch.Tensor:
            calls.append(type(ctx).__name__)  # the function's backward node: _BlockedAttentionBackward, ...
            return forward(ctx, *inputs)  # type: ignore[no-any-return]

        monkeypatch.setattr(function, "forward", staticmethod(counted))
    ids = torch.randint(3, 60, (2, 11), generator=torch.Generator().manual_seed(2))
    for precision, name in (("bf16", "_BlockedAttention"), ("no", "_FlashAttention")):
        model = load_model_to_train(
            model_settings(tiny_model_path, mixed_precision=precision), torch.device("cpu")
        )
        assert cpu_attention.installed()
        with computing_in(model, autocast_dtype(precision, torch.device("cpu")), torch.device("cpu")):
            model(input_ids=ids, labels=ids).loss.backward()
            assert calls == [f"{name}Backward"] * 2  # the tiny model's two layers
            with torch.no_grad():  # generation and scoring without gradients: sdpa
                model(input_ids=ids)
            assert len(calls) == 2
        calls.clear()


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> int:
    """The bytes of the distinct storages a training forward keeps for backward."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    return sum(storages.values())


def test_a_layer_keeps_its_keys_and_values_unrepeated_under_a_mask(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a padding mask, transformers' sdpa path repeats keys and values for every query head, and
    sdpa keeps the copies for backward and a float copy of the boolean mask in every layer. Ours keeps
    the keys and values as they are (2*B*T*(H - Hkv)*D floats less per layer), and one float copy of
    the mask for all layers; nothing else differs. (The decoder layers' own saved-tensor
    hooks, trainers/kernels/activation_memory.py, are left out: this test's hooks see only what no inner hook
    takes.)"""
    monkeypatch.setattr(kernel_install, "save_less_activation", lambda model: 0)
    model = load_model_to_train(model_settings(tiny_model_path, mixed_precision="no"), torch.device("cpu"))
    ids = torch.randint(3, 60, (2, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # row 1 padded: the model builds a 4-D mask
    ours = _saved_bytes(model, ids, mask)
    varlen_attention.uninstall()  # transformers' own sdpa function
    theirs = _saved_bytes(model, ids, mask)
    config: Any = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    keys_and_values, mask_elements = ids.numel() * dim * 2 * (heads - kv_heads), ids.numel() * ids.shape[1]
    per_layer = (keys_and_values + mask_elements) * 4  # float32
    assert theirs - ours == config.num_hidden_layers * per_layer - mask_elements * 4


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
