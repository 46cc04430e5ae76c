"""Loss functions: pure functions on tensors.

``token_cross_entropy`` is the causal-LM negative log-likelihood summed over target tokens,
-sum_t log p(x_t | x_<t) (Radford et al. 2018, eq. 1), restricted to positions whose label is not
``IGNORE_INDEX``. It returns sums, not means, so that the caller can normalise by the number of target
tokens in a whole accumulated batch: the same loss whether examples are padded or packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenLossSums:
    loss_sum: torch.Tensor  # scalar, float32, differentiable
    n_tokens: int  # target tokens counted
    n_correct: torch.Tensor  # targets that are the argmax of the logits (a scalar: no host sync)


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> TokenLossSums:
    """Summed next-token cross-entropy.

    logits: [B, T, V] for inputs of length T; labels: [B, T], unshifted (``labels[:, t]`` is the target
    predicted from positions < t, as in Hugging Face models), ``IGNORE_INDEX`` where there is no target.
    Only target positions are upcast to float32, so the full [B, T, V] tensor is never copied.
    """
    return next_token_cross_entropy(logits[:, :-1, :], labels[:, 1:])


def target_positions(labels: torch.Tensor) -> torch.Tensor:
    """The positions t (1-D, ascending) whose next token ``labels[:, t + 1]`` is a target in some row: the
    only positions whose logits the loss reads. Pass them as ``logits_to_keep`` so that the LM head runs
    on those hidden states only and [B, T, V] is never materialised; the targets are then
    ``labels[:, positions + 1]``."""
    return (labels[:, 1:] != IGNORE_INDEX).any(dim=0).nonzero().squeeze(-1)


def next_token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> TokenLossSums:
    """Summed cross-entropy of ``logits`` [B, K, V] against ``targets`` [B, K], already aligned (the
    logits at a position against the token that follows it), ``IGNORE_INDEX`` where there is no target."""
    mask = targets != IGNORE_INDEX
    target_logits = logits[mask].float()  # [N, V]
    kept = targets[mask]  # [N]
    loss_sum = F.cross_entropy(target_logits, kept, reduction="sum")
    n_correct = (target_logits.detach().argmax(dim=-1) == kept).sum()
    return TokenLossSums(loss_sum=loss_sum, n_tokens=int(kept.numel()), n_correct=n_correct)
