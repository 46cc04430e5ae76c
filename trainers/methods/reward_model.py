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

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

from trainers.core.callbacks import TrainingCallbacks, TrainResult
from trainers.core.loop import LossSums
from trainers.data.packing import PackedLayout
from trainers.data.preference import (
    PreferenceBatch,
    encode_prompt_completion,
)
from trainers.families.entry import Rows
from trainers.families.pairs import PairConfig, train_on_pairs
from trainers.modeling.loading import (
    classifier_parts,
    decoder_hidden_states,
    load_sequence_classifier,
    load_tokenizer,
    pick_device,
)

if TYPE_CHECKING:
    from trainers.families.rl import RewardSet

RewardScorer = Callable[[list[str], list[str]], list[float]]


@dataclass
class RewardModelConfig(PairConfig):
    """Configuration of a reward-model run: the fields of ``trainers.families.pairs.PairConfig`` (``max_length``,
    ``max_prompt_length``); rows may carry a numeric ``margin`` (default 0).

    Shared fields as the reward model reads them: ``model_path`` is a causal LM on which a scalar
    ``score`` head is added; ``use_lora`` trains a LoRA adapter plus the whole head (merged for the final
    checkpoint), and ``lora_target_modules=None`` adapts every linear layer but the head. ``n_epochs``
    passes over the training pairs; ``batch_size`` counts pairs, so the forward pass sees 2 * batch_size
    sequences. ``seed`` also seeds the head's initialisation. ``eval_steps`` also paces
    ``valid_accuracy``.
    """

    method: ClassVar[str] = "reward_model"

    learning_rate: float = 1e-4


def pairwise_loss(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, margins: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-pair Bradley–Terry loss -log σ(r_w - r_l - m): [B] from [B] rewards and optional [B] margins.

    Ouyang et al. 2022, eq. 1; the margin m is Llama 2's (Touvron et al. 2023, eq. 2).
    """
    diff = chosen_rewards - rejected_rewards
    return -F.logsigmoid(diff - margins if margins is not None else diff)


def reward_scores(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    packed: PackedLayout | None = None,
) -> torch.Tensor:
    """[N] float32 scores of right-padded rows (the head's output at each row's last non-pad token); the
    decoder runs on the ``packed`` layout when one is given and the model's parts allow it."""
    parts = classifier_parts(model) if packed is not None else None
    if parts is None:
        logits: torch.Tensor = model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).logits
        return logits.squeeze(-1).float()
    hidden = decoder_hidden_states(parts.decoder, input_ids, attention_mask, packed)
    # the token transformers' classifier pools: the rightmost one whose id is not the pad id
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = (positions * (input_ids != parts.pad_token_id)).argmax(-1)
    pooled = hidden[torch.arange(input_ids.shape[0], device=input_ids.device), last]
    score: torch.Tensor = parts.head(pooled)
    return score.squeeze(-1).float()


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
    return load_sequence_classifier(config, device, pad_token_id=pad_token_id)


def load_reward_scorer(
    path: str | Path,
    *,
    device: torch.device | None = None,
    batch_size: int = 16,
    max_length: int = 1024,
) -> RewardScorer:
    """A ``(prompts, completions) -> scores`` callable on a reward-model folder (a final checkpoint's
    ``model/``): batched, without gradients. The one scorer of the library: the ``score_model`` grader
    (``trainers.rewards.graders.ScoreModel``) is this.

    A prompt is plain text or text already rendered by the chat template with its generation prompt
    (``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``, as RL rollouts render
    ``{"messages"}`` rows); a completion is the generated text. Pairs are encoded as training encodes
    them (``encode_prompt_completion``): BOS unless the prompt starts with it, EOS appended unless the
    completion ends with it, prompt and completion tokenized separately, truncated to ``max_length``.
    Raises ``OSError`` if the folder cannot be loaded, ``ValueError`` if it is not a one-output model.
    """
    device = device or pick_device()
    tokenizer = load_tokenizer(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32)
    if model.config.num_labels != 1:
        raise ValueError(f"a reward model has one output (num_labels=1), not {model.config.num_labels}")
    model = torch.nn.Module.to(model, device).eval()
    pad_id = tokenizer.pad_token_id
    assert isinstance(pad_id, int)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = pad_id

    @torch.no_grad()
    def score(prompts: list[str], completions: list[str]) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        out: list[float] = []
        for start in range(0, len(prompts), batch_size):
            rows = [
                encode_prompt_completion(tokenizer, p, c, max_length=max_length)
                for p, c in zip(
                    prompts[start : start + batch_size], completions[start : start + batch_size], strict=True
                )
            ]
            width = max(len(r) for r in rows)
            input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, ids in enumerate(rows):
                input_ids[i, : len(ids)] = torch.tensor(ids)
                attention_mask[i, : len(ids)] = 1
            out += reward_scores(model, input_ids.to(device), attention_mask.to(device)).tolist()
        return out

    return score
