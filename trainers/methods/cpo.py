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
from trainers.core.config import knob
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
    """Configuration of a CPO run: ``PairConfig``'s fields plus the ``cpo`` entry's own hyperparameters
    (``trainers.registry``; docs/methods.md lists them with their docs and ranges). ``loss_type="simpo"``
    with ``cpo_alpha`` > 0 is CPO-SimPO; ``cpo_alpha`` 0 is a pure preference loss."""

    method: ClassVar[str] = "cpo"

    learning_rate: float = knob("cpo", "learning_rate")
    beta: float = knob("cpo", "beta")
    loss_type: str = knob("cpo", "loss_type")
    cpo_alpha: float = knob("cpo", "cpo_alpha")
    simpo_gamma: float = knob("cpo", "simpo_gamma")
    label_smoothing: float = knob("cpo", "label_smoothing")


@dataclass
class SimPOConfig(PairConfig):
    """Configuration of a SimPO run: ``PairConfig``'s fields plus the ``simpo`` entry's own hyperparameters
    (``trainers.registry``; docs/methods.md lists them with their docs and ranges). The reward is the
    length-normalised β/|y| · log π(y|x); ``cpo_alpha`` 0 is SimPO as published."""

    method: ClassVar[str] = "simpo"

    learning_rate: float = knob("simpo", "learning_rate")
    beta: float = knob("simpo", "beta")
    simpo_gamma: float = knob("simpo", "simpo_gamma")
    cpo_alpha: float = knob("simpo", "cpo_alpha")
    label_smoothing: float = knob("simpo", "label_smoothing")


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
