"""Everything the benches take from our trainers, in one module.

The benches compare ``trainers`` with TRL; this is the one place that names ``trainers``' modules, so
that moving them (the ``trainers/`` reorganisation into ``core/ data/ modeling/ ... methods/``) means
editing the imports below and nothing else in ``bench/``. Import it lazily (``from bench import ours``
inside a function): a bench child then loads only the trainers it runs, and the parent none.

Besides plain re-exports, ``keep_cudnn_attention`` is a bench-only switch of a trainer-process default,
for the GPU suite's on/off measurement of that lever (``bench/gpu_suite.py``).
"""

from __future__ import annotations

import torch

from trainers.core.callbacks import TrainingCallbacks
from trainers.core.loop import NullCallbacks, epoch_permutation
from trainers.data.collate import SFTBatch
from trainers.data.sft import tokenize_sft_rows
from trainers.families.rollout import tokenize_rl_rows
from trainers.kernels import install as _kernels
from trainers.losses.causal_lm import IGNORE_INDEX, target_positions
from trainers.methods.dpo import DPOConfig, train_dpo
from trainers.methods.grpo import GRPOConfig, train_grpo
from trainers.methods.ppo import PPOConfig, train_ppo
from trainers.methods.reward_model import RewardModelConfig, train_reward_model
from trainers.methods.sft import SFTConfig, sft_loss, train_sft
from trainers.modeling.loading import load_tokenizer
from trainers.modeling.tiny_model import CORPUS_PATH, build_tiny_model
from trainers.rewards.graders import ScoreModel
from trainers.rewards.reward_set import RewardSet

__all__ = [
    "CORPUS_PATH",
    "IGNORE_INDEX",
    "DPOConfig",
    "GRPOConfig",
    "NullCallbacks",
    "PPOConfig",
    "RewardModelConfig",
    "RewardSet",
    "SFTBatch",
    "SFTConfig",
    "ScoreModel",
    "TrainingCallbacks",
    "build_tiny_model",
    "epoch_permutation",
    "keep_cudnn_attention",
    "load_tokenizer",
    "sft_loss",
    "target_positions",
    "tokenize_rl_rows",
    "tokenize_sft_rows",
    "train_dpo",
    "train_grpo",
    "train_ppo",
    "train_reward_model",
    "train_sft",
]


def keep_cudnn_attention() -> None:
    """Leave sdpa's cuDNN backend on in this process: a trainer turns it off on CUDA
    (``trainers.kernels.install.use_plan_free_attention``: cuDNN plans every new sequence length), and
    the GPU suite measures that choice against keeping it."""

    def keep(device: torch.device) -> None:
        del device  # cuDNN attention stays as torch has it

    _kernels.use_plan_free_attention = keep
