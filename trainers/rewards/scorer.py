"""A reward model as a reward function: ``(prompts, completions) -> scores`` on a ``reward_model`` run's
final ``model/`` folder. The ``score_model`` grader (``trainers.rewards.graders.ScoreModel``) is this."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification

from trainers.data.preference import encode_prompt_completion
from trainers.modeling.loading import load_tokenizer, pick_device, reward_scores

RewardScorer = Callable[[list[str], list[str]], list[float]]


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
