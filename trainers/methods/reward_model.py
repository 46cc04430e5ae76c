"""Reward model: a scalar head on a causal LM, fit to preference pairs with a Bradley–Terry loss.

    L(φ) = - E_(x, y_w, y_l) log σ(r_φ(x, y_w) - r_φ(x, y_l) - m(x))

(Ouyang et al. 2022, eq. 1; the optional per-pair margin m as in Llama 2, Touvron et al. 2023, eq. 2),
with r_φ(x, y) the head's output at the last token of prompt + completion. The final checkpoint is a
plain ``AutoModelForSequenceClassification`` folder (LoRA merged) that ``load_reward_scorer`` turns into
a ``(prompts, completions) -> scores`` callable for graders and PPO. The loop is ``trainers.core.loop``.

    python -c "
    from trainers.methods.reward_model import RewardModelConfig, train_reward_model
    from trainers.modeling.tiny_model import build_tiny_model
    rows = [{'prompt': 'Is the sky blue?', 'chosen': ' Yes.', 'rejected': ' No.'}] * 16
    print(train_reward_model(RewardModelConfig(str(build_tiny_model('/tmp/tiny')), '/tmp/rm-out'), rows))"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from trainers.core.callbacks import TrainingCallbacks, TrainResult
from trainers.core.config import knob
from trainers.core.loop import LossSums
from trainers.data.preference import (
    PreferenceBatch,
)
from trainers.families.entry import Rows, load_classifier_to_train
from trainers.families.pairs import PairConfig, train_on_pairs
from trainers.modeling.loading import reward_scores

if TYPE_CHECKING:
    from trainers.rewards.reward_set import RewardSet


@dataclass
class RewardModelConfig(PairConfig):
    """Configuration of a reward-model run: the fields of ``trainers.families.pairs.PairConfig``
    (``max_length``,
    ``max_prompt_length``); rows may carry a numeric ``margin`` (default 0).

    Shared fields as the reward model reads them: ``model_path`` is a causal LM on which a scalar
    ``score`` head is added; ``use_lora`` trains a LoRA adapter plus the whole head (merged for the final
    checkpoint), and ``lora_target_modules=None`` adapts every linear layer but the head. ``n_epochs``
    passes over the training pairs; ``batch_size`` counts pairs, so the forward pass sees 2 * batch_size
    sequences. ``seed`` also seeds the head's initialisation. ``eval_steps`` also paces
    ``valid_accuracy``.
    """

    method: ClassVar[str] = "reward_model"

    learning_rate: float = knob("reward_model", "learning_rate")


def pairwise_loss(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, margins: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-pair Bradley–Terry loss -log σ(r_w - r_l - m): [B] from [B] rewards and optional [B] margins.

    Ouyang et al. 2022, eq. 1; the margin m is Llama 2's (Touvron et al. 2023, eq. 2).
    """
    diff = chosen_rewards - rejected_rewards
    return -F.logsigmoid(diff - margins if margins is not None else diff)


def reward_model_loss(model: torch.nn.Module, batch: PreferenceBatch) -> LossSums:
    """The loop's loss function: summed pairwise losses and metrics of a micro-batch (one unit per pair)."""
    n = batch.n_pairs
    scores = reward_scores(model, batch.input_ids, batch.attention_mask, packed=batch.packed)
    chosen, rejected = scores[:n], scores[n:]
    losses = pairwise_loss(chosen, rejected, batch.margins)
    chosen, rejected = chosen.detach(), rejected.detach()
    metrics = {  # tensors: the loop reads them once per step, not once per micro-batch
        "accuracy": (chosen > rejected).sum().float(),
        "rewards/chosen": chosen.sum(),
        "rewards/rejected": rejected.sum(),
        "rewards/margins": (chosen - rejected).sum(),
    }
    return LossSums(loss=losses.sum(), metrics=metrics)


def train_reward_model(
    config: RewardModelConfig,
    train_rows: Rows,
    valid_rows: Rows | None = None,
    callbacks: TrainingCallbacks | None = None,
    *,
    rewards: RewardSet | None = None,
) -> TrainResult:
    """Train a reward model on preference rows; raise ``DataError`` when the data is at fault."""
    return train_on_pairs(
        config, reward_model_loss, train_rows, valid_rows, callbacks, rewards=rewards, load=_classifier
    )


def _classifier(config: PairConfig, device: torch.device, pad_token_id: int) -> torch.nn.Module:
    return load_classifier_to_train(config, device, pad_token_id=pad_token_id)
