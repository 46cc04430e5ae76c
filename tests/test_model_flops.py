"""bench/model_flops.py's FLOP count, which the GPU tables' MFU column rests on: the decoder's linear
weights are counted from the config exactly as a built model holds them, and the per-example terms add
up as the formula says."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.model_flops import RowShape, decoder_matmul_weights, flops_per_real_token, training_flops


@pytest.mark.parametrize("bias", [False, True])
def test_the_decoder_weights_are_those_of_the_built_model(bias: bool) -> None:
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        attention_bias=bias,
    )
    model = LlamaForCausalLM(config)
    linear = sum(
        m.weight.numel() for name, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)
    )
    assert decoder_matmul_weights(config) == linear


def test_the_formula_per_example() -> None:
    config = LlamaConfig(
        vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2
    )
    body = decoder_matmul_weights(config)
    rows = [RowShape(tokens=10, targets=4), RowShape(tokens=3, targets=3)]
    expected = sum(6 * body * t + 6 * 100 * 8 * k + 12 * 2 * 8 * t * t for t, k in [(10, 4), (3, 3)])
    assert training_flops(config, rows) == expected
    assert flops_per_real_token(config, rows) == expected / 13
