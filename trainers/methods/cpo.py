"""Contrastive Preference Optimization (CPO) and SimPO: DPO-style preference losses without a reference
model, plus (CPO) a behaviour-cloning NLL on the chosen answer.

    CPO:   L(θ) = -E log σ(β log π_θ(y_w|x) - β log π_θ(y_l|x))  +  α E[-log π_θ(y_w|x)]
    SimPO: L(θ) = -E log σ( (β/|y_w|) log π_θ(y_w|x) - (β/|y_l|) log π_θ(y_l|x) - γ )

(Xu et al. 2024, eq. 3 with the NLL regulariser of eq. 5; Meng et al. 2024, eq. 6: the length-normalised
reward, target margin γ). SimPO is CPO's ``loss_type="simpo"`` (as in TRL), run on its own by
``train_simpo`` with its own defaults (``SimPOConfig``: no NLL term, α = 0). The NLL is the chosen
completion's mean token NLL; the loss is ``trainers.losses.preference.cpo_loss``, the run
``trainers.families.pairs``.

    python -c "
    from trainers.methods.cpo import SimPOConfig, train_simpo
    from trainers.modeling.tiny_model import build_tiny_model
    rows = [{'prompt': 'Is the sky blue?', 'chosen': ' Yes.', 'rejected': ' No.'}] * 16
    print(train_simpo(SimPOConfig(str(build_tiny_model('/tmp/tiny')), '/tmp/simpo-out', max_steps=10), rows))"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from trainers.core.callbacks import TrainingCallbacks, TrainResult
from trainers.core.loop import LossSums
from trainers.data.preference import PreferenceBatch
from trainers.families.entry import Rows
from trainers.families.pairs import PairConfig, pair_forward, pair_metrics, train_on_pairs
from trainers.losses.preference import cpo_loss

if TYPE_CHECKING:
    from trainers.rewards.reward_set import RewardSet

# the losses on per-token mean log-probs (length-normalised); the others sum over the completion
LENGTH_NORMALISED = ("ipo", "simpo")


@dataclass
class CPOConfig(PairConfig):
    """Configuration of a CPO run: the fields of ``trainers.families.pairs.PairConfig``, plus

    Method:
        beta: β, the temperature of the preference term.
        loss_type: ``sigmoid`` (CPO), ``hinge`` (SLiC), ``ipo`` or ``simpo`` (SimPO's loss, with the NLL
            term: CPO-SimPO); ``ipo`` and ``simpo`` use per-token mean log-probs.
        cpo_alpha: α, the weight of the chosen completion's NLL (0: none, pure preference loss).
        simpo_gamma: γ, SimPO's target reward margin (``loss_type="simpo"`` only).
        label_smoothing: ε for ``sigmoid`` and ``simpo``: the label is assumed flipped with probability ε.
    """

    method: ClassVar[str] = "cpo"

    learning_rate: float = 5e-5
    beta: float = 0.1
    loss_type: str = "sigmoid"
    cpo_alpha: float = 1.0
    simpo_gamma: float = 0.5
    label_smoothing: float = 0.0


@dataclass
class SimPOConfig(PairConfig):
    """Configuration of a SimPO run: the fields of ``trainers.families.pairs.PairConfig``, plus

    Method:
        beta: β, the scale of the length-normalised reward β/|y| · log π(y|x) (the authors use 2 to 2.5).
        simpo_gamma: γ, the target reward margin (the authors advise γ/β around 0.5).
        cpo_alpha: α, the weight of an NLL term on the chosen completion (0: SimPO as published).
        label_smoothing: ε: the label is assumed flipped with probability ε.
    """

    method: ClassVar[str] = "simpo"

    learning_rate: float = 1e-5
    beta: float = 2.0
    simpo_gamma: float = 1.0
    cpo_alpha: float = 0.0
    label_smoothing: float = 0.0


@dataclass(frozen=True)
class CPOLoss:
    """The loop's loss function: summed CPO/SimPO losses and metrics of a micro-batch (one unit per pair)."""

    beta: float
    loss_type: str
    cpo_alpha: float
    simpo_gamma: float
    label_smoothing: float

    def __call__(self, model: torch.nn.Module, batch: PreferenceBatch) -> LossSums:
        n = batch.n_pairs
        out = pair_forward(model, batch, nll_on_prompt=False, nll_grad=self.cpo_alpha > 0)
        logps = out.mean_logps if self.loss_type in LENGTH_NORMALISED else out.logps
        losses, chosen_rewards, rejected_rewards = cpo_loss(
            logps[:n],
            logps[n:],
            beta=self.beta,
            loss_type=self.loss_type,
            label_smoothing=self.label_smoothing,
            simpo_gamma=self.simpo_gamma,
        )
        loss = losses.sum()
        if self.cpo_alpha > 0:
            loss = loss + n * self.cpo_alpha * out.chosen_nll
        return LossSums(loss=loss, metrics=pair_metrics(out, chosen_rewards, rejected_rewards, logps))


def train_cpo(
    config: CPOConfig,
    train_rows: Rows,
    valid_rows: Rows | None = None,
    callbacks: TrainingCallbacks | None = None,
    *,
    rewards: RewardSet | None = None,
) -> TrainResult:
    """CPO-train ``config.model_path`` on preference rows; raise ``DataError`` when the data is at fault."""
    c = config
    loss = CPOLoss(c.beta, c.loss_type, c.cpo_alpha, c.simpo_gamma, c.label_smoothing)
    return train_on_pairs(c, loss, train_rows, valid_rows, callbacks, rewards=rewards)


def train_simpo(
    config: SimPOConfig,
    train_rows: Rows,
    valid_rows: Rows | None = None,
    callbacks: TrainingCallbacks | None = None,
    *,
    rewards: RewardSet | None = None,
) -> TrainResult:
    """SimPO-train ``config.model_path`` on preference rows; raise ``DataError`` when the data is at fault."""
    c = config
    loss = CPOLoss(c.beta, "simpo", c.cpo_alpha, c.simpo_gamma, c.label_smoothing)
    return train_on_pairs(c, loss, train_rows, valid_rows, callbacks, rewards=rewards)
