"""`trainers.kernels.install.use_plan_free_attention`: a trainer on CUDA keeps sdpa off cuDNN's attention
(which plans anew for every sequence length: 4.9x slower DPO steps on an H200, git log -p
docs/benchmarks.md); on the CPU the switch is left alone. The switch is a process-wide flag, so each test
restores it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from trainers.kernels import varlen_attention
from trainers.kernels.install import use_attention_kernels, use_plan_free_attention


@pytest.fixture(autouse=True)
def _restore_cudnn_sdp() -> Iterator[None]:
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_a_cuda_trainer_turns_cudnn_attention_off() -> None:
    torch.backends.cuda.enable_cudnn_sdp(True)
    use_plan_free_attention(torch.device("cuda", 0))
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    # the other sdpa kernels stay available
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()


def test_a_cpu_trainer_leaves_the_switch_alone() -> None:
    torch.backends.cuda.enable_cudnn_sdp(True)
    use_plan_free_attention(torch.device("cpu"))
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.fixture
def _restore_sdpa() -> Iterator[None]:
    yield
    varlen_attention.uninstall()


@pytest.mark.usefixtures("_restore_sdpa")
def test_a_cuda_trainer_routes_packed_sequences_to_the_varlen_kernel() -> None:
    """Where this torch has the variable-length kernel (>= 2.10, as the pinned 2.13 does), a CUDA trainer
    process routes sdpa through ``varlen_attention``; a CPU one keeps transformers' own sdpa."""
    assert varlen_attention.varlen_attn is not None
    use_attention_kernels(torch.device("cpu"))
    assert not varlen_attention.installed()
    use_attention_kernels(torch.device("cuda", 0))
    assert varlen_attention.installed()
    assert not torch.backends.cuda.cudnn_sdp_enabled()
