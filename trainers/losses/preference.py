"""Reference-free preference losses (ORPO, CPO, SimPO) and KTO's: pure functions on tensors.

Each takes per-sequence completion log-probabilities, log π(y|x) summed (or averaged, where the method
length-normalises) over the completion tokens, and returns per-example losses, the loss to *minimise*,
with detached implicit rewards for the metrics. DPO's loss, which needs a reference model, is
``trainers.losses.preference.dpo_loss``; KTO also needs one, but gets its log-ratios already computed.

>>> import torch
>>> losses, _, _, _ = odds_ratio_loss(torch.tensor([-0.5]), torch.tensor([-0.5]), beta=1.0)
>>> round(losses.item(), 4)  # equal odds: -log σ(0) = log 2
0.6931
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainers.registry import choices

CPO_LOSS_TYPES = choices("cpo", "loss_type")
DPO_LOSS_TYPES = choices("dpo", "loss_type")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate near 0 and for very negative x (Mächler 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def odds_ratio_loss(
    chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, *, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO's odds-ratio term (Hong et al. 2024, eqs. 6-7), per pair.

    Inputs are [B] *mean* per-token completion log-probs, log P(y|x) = (1/|y|) Σ_t log π(y_t|x, y_<t)
    (the paper's length-normalised likelihood, eq. 4). With odds(y|x) = P(y|x) / (1 - P(y|x)):

        L_OR = -log σ(log odds(y_w|x) - log odds(y_l|x))

    Returns (β·L_OR, chosen_rewards, rejected_rewards, log_odds), each [B]: the rewards are β·log P
    (detached), ``log_odds`` the log odds ratio (detached). The full ORPO objective adds the chosen
    sequence's NLL: L = L_SFT + β·L_OR (the paper's λ is β here, as in TRL).
    """
    chosen_logps, rejected_logps = chosen_logps.float(), rejected_logps.float()
    log_odds = (chosen_logps - rejected_logps) - (log1mexp(chosen_logps) - log1mexp(rejected_logps))
    losses = -beta * F.logsigmoid(log_odds)
    return losses, beta * chosen_logps.detach(), beta * rejected_logps.detach(), log_odds.detach()


def cpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The preference term of CPO (Xu et al. 2024) and SimPO (Meng et al. 2024), per pair; no reference.

    Inputs are [B] completion log-probs: summed for ``sigmoid`` and ``hinge``, *mean per token* for
    ``ipo`` and ``simpo`` (the caller reduces). With h = log π(y_w|x) - log π(y_l|x):

    - ``sigmoid``: -log σ(β h), CPO's preference loss (Xu et al. 2024, eq. 3, the DPO loss with the
      reference dropped); with label smoothing ε, -(1-ε) log σ(β h) - ε log σ(-β h).
    - ``hinge``: max(0, 1 - β h) (SLiC, Zhao et al. 2023).
    - ``ipo``: (h - 1/(2β))² (Azar et al. 2023, eq. 17) on length-normalised log-probs.
    - ``simpo``: -log σ(β h - γ) on length-normalised log-probs (Meng et al. 2024, eq. 6: the reward is
      β/|y| · log π(y|x) and γ the target margin), label-smoothed like ``sigmoid``.

    Returns (losses, chosen_rewards, rejected_rewards), each [B]; the rewards are β·log π (detached).
    CPO's full objective adds α times the chosen completion's NLL (the caller adds it).
    """
    h = chosen_logps - rejected_logps
    if loss_type in ("sigmoid", "simpo"):
        logits = beta * h - (simpo_gamma if loss_type == "simpo" else 0.0)
        losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"loss_type must be one of {CPO_LOSS_TYPES}, not {loss_type!r}")
    return losses, beta * chosen_logps.detach(), beta * rejected_logps.detach()


def kto_loss(
    chosen_logratios: torch.Tensor,
    rejected_logratios: torch.Tensor,
    kl: torch.Tensor,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO's value-based loss (Ethayarajh et al. 2024, eq. 7), per example.

    ``chosen_logratios`` [C] and ``rejected_logratios`` [R] are log π_θ(y|x) - log π_ref(y|x) (summed over
    the completion) of the desirable and the undesirable examples; ``kl`` is the scalar reference point
    z₀, an estimate of KL(π_θ || π_ref) from mismatched (x, y') pairs, clamped at 0 and detached (no
    gradient flows through it, as in the paper). With r = log-ratio:

        desirable:   λ_D (1 - σ(β (r - z₀)))
        undesirable: λ_U (1 - σ(β (z₀ - r)))

    Returns (desirable losses [C], undesirable losses [R]), already weighted by λ_D and λ_U; the
    objective is their mean over all C + R examples.
    """
    chosen = desirable_weight * (1 - torch.sigmoid(beta * (chosen_logratios - kl)))
    rejected = undesirable_weight * (1 - torch.sigmoid(beta * (kl - rejected_logratios)))
    return chosen, rejected


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair preference losses and implicit rewards.

    All inputs are [B] summed completion log-probs, log π(y|x); returns (losses, chosen_rewards,
    rejected_rewards), each [B], the rewards β·(log π_θ(y|x) - log π_ref(y|x)) detached. With
    h = (log π_θ(y_w) - log π_ref(y_w)) - (log π_θ(y_l) - log π_ref(y_l)):

    - ``sigmoid``: -log σ(β h), DPO (Rafailov et al. 2023, eq. 7); with label smoothing ε,
      -(1-ε) log σ(β h) - ε log σ(-β h), conservative DPO (Mitchell 2023).
    - ``ipo``: (h - 1/(2β))², IPO (Azar et al. 2023, eq. 17, β = τ). Given ``chosen_lengths`` and
      ``rejected_lengths`` ([B] completion token counts) each log-ratio is divided by its length first,
      the normalisation the IPO authors used for the paper's results (and TRL does).
    - ``hinge``: max(0, 1 - β h), SLiC-HF (Zhao et al. 2023, eq. 1 with δ = 1/β).
    """
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    if loss_type == "sigmoid":
        h = chosen_logratios - rejected_logratios
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        if chosen_lengths is not None and rejected_lengths is not None:
            h = chosen_logratios / chosen_lengths.clamp(min=1) - rejected_logratios / rejected_lengths.clamp(
                min=1
            )
        else:
            h = chosen_logratios - rejected_logratios
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * (chosen_logratios - rejected_logratios))
    else:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, not {loss_type!r}")
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
