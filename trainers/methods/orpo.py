"""Odds Ratio Preference Optimization (ORPO): SFT on the chosen answer plus an odds-ratio penalty on the
rejected one, in one stage and without a reference model.

    L(θ) = E_(x, y_w, y_l) [ L_SFT(x, y_w) - β log σ( log odds_θ(y_w|x) / odds_θ(y_l|x) ) ],
    odds_θ(y|x) = P_θ(y|x) / (1 - P_θ(y|x)),  P_θ(y|x) = exp( (1/|y|) Σ_t log π_θ(y_t | x, y_<t) )

(Hong et al. 2024, eqs. 4-7; β is the paper's λ). L_SFT is the chosen sequence's mean token NLL over the
prompt and the completion, as in ORPO's original code and TRL (huggingface/trl#1516, kept in #2527). The
loss is ``trainers.losses.preference.odds_ratio_loss``, the run ``trainers.families.pairs``.

    python -c "
    from trainers.methods.orpo import ORPOConfig, train_orpo
    from trainers.modeling.tiny_model import build_tiny_model
    rows = [{'prompt': 'Is the sky blue?', 'chosen': ' Yes.', 'rejected': ' No.'}] * 16
    print(train_orpo(ORPOConfig(str(build_tiny_model('/tmp/tiny')), '/tmp/orpo-out', max_steps=10), rows))"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from trainers.core.callbacks import TrainingCallbacks, TrainResult
from trainers.core.config import knob
from trainers.core.loop import LossSums
from trainers.data.preference import PreferenceBatch
from trainers.families.entry import Rows
from trainers.families.pairs import PairConfig, pair_forward, pair_metrics, train_on_pairs
from trainers.losses.preference import odds_ratio_loss

if TYPE_CHECKING:
    from trainers.rewards.reward_set import RewardSet


@dataclass
class ORPOConfig(PairConfig):
    """Configuration of an ORPO run: ``PairConfig``'s fields plus the ``orpo`` entry's own hyperparameters
    (``trainers.registry``; docs/methods.md lists them with their docs and ranges)."""

    method: ClassVar[str] = "orpo"

    learning_rate: float = knob("orpo", "learning_rate")
    beta: float = knob("orpo", "beta")


@dataclass(frozen=True)
class ORPOLoss:
    """The loop's loss function: summed ORPO losses and metrics of a micro-batch (one unit per pair)."""

    beta: float

    def __call__(self, model: torch.nn.Module, batch: PreferenceBatch) -> LossSums:
        n = batch.n_pairs
        out = pair_forward(model, batch, nll_on_prompt=True)
        logps = out.mean_logps
        losses, chosen_rewards, rejected_rewards, log_odds = odds_ratio_loss(
            logps[:n], logps[n:], beta=self.beta
        )
        metrics = pair_metrics(out, chosen_rewards, rejected_rewards, logps)
        metrics["log_odds_ratio"] = F.logsigmoid(log_odds.detach()).sum()
        metrics["log_odds_chosen"] = log_odds.detach().sum()
        return LossSums(loss=n * out.chosen_nll + losses.sum(), metrics=metrics)


def train_orpo(
    config: ORPOConfig,
    train_rows: Rows,
    valid_rows: Rows | None = None,
    callbacks: TrainingCallbacks | None = None,
    *,
    rewards: RewardSet | None = None,
) -> TrainResult:
    """ORPO-train ``config.model_path`` on preference rows; raise ``DataError`` when the data is at fault."""
    return train_on_pairs(config, ORPOLoss(config.beta), train_rows, valid_rows, callbacks, rewards=rewards)
