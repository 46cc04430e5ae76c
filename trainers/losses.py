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
    n_correct: int  # targets that are the argmax of the logits


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> TokenLossSums:
    """Summed next-token cross-entropy.

    logits: [B, T, V] for inputs of length T; labels: [B, T], unshifted (``labels[:, t]`` is the target
    predicted from positions < t, as in Hugging Face models), ``IGNORE_INDEX`` where there is no target.
    Only target positions are upcast to float32, so the full [B, T, V] tensor is never copied.
    """
    shift_logits = logits[:, :-1, :]
    shift_labels = labels[:, 1:]
    mask = shift_labels != IGNORE_INDEX
    target_logits = shift_logits[mask].float()  # [N, V]
    targets = shift_labels[mask]  # [N]
    loss_sum = F.cross_entropy(target_logits, targets, reduction="sum")
    n_correct = int((target_logits.detach().argmax(dim=-1) == targets).sum().item())
    return TokenLossSums(loss_sum=loss_sum, n_tokens=int(targets.numel()), n_correct=n_correct)
