"""Reward model: the Bradley–Terry loss equals a hand computation and TRL's RewardTrainer loss on the same
batch, training separates a separable preference, and the final checkpoint is a plain sequence
classifier that ``load_reward_scorer`` uses."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerBase
from trl.trainer.reward_trainer import RewardTrainer

from tests.trainers.helpers import Recorder
from trainers.data.preference import collate_preferences, tokenize_preference_rows
from trainers.families.rollout import tokenize_rl_rows
from trainers.methods.reward_model import (
    RewardModelConfig,
    pairwise_loss,
    reward_model_loss,
    train_reward_model,
)
from trainers.modeling.loading import load_tokenizer, reward_scores
from trainers.rewards.graders import build_grader
from trainers.rewards.scorer import load_reward_scorer

CITIES = ["Paris", "Lima", "Tokyo", "Dublin", "Rome", "Oslo", "Madrid", "Cairo"]


def separable_rows(n: int, offset: int = 0) -> list[dict[str, Any]]:
    rows = []
    for i in range(offset, offset + n):
        city = CITIES[i % 8]
        rows.append(
            {
                "prompt": f"Is {city} a city? ({i})",
                "chosen": f" Yes, {city} is.",
                "rejected": f" No, {city} is not.",
            }
        )
    return rows


@pytest.fixture
def make_config(tiny_model_path: Path, tmp_path: Path) -> Callable[..., RewardModelConfig]:
    def make(**overrides: Any) -> RewardModelConfig:
        fields: dict[str, Any] = {"model_path": str(tiny_model_path), "output_dir": str(tmp_path / "out")}
        return RewardModelConfig(**(fields | overrides))

    return make


def load_classifier(path: Path, pad_token_id: int) -> torch.nn.Module:
    torch.manual_seed(0)  # the score head is initialised at random
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, pad_token_id=pad_token_id, dtype=torch.float32
    )
    return model.eval()


@torch.no_grad()
def test_pairwise_loss_equals_hand_computation_and_trl(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    rows = [{**row, "margin": m} for row, m in zip(separable_rows(4), [0.0, 0.5, 1.0, -0.25], strict=True)]
    examples = tokenize_preference_rows(rows, tokenizer, max_length=64)
    model = load_classifier(tiny_model_path, tokenizer.pad_token_id)
    batch = collate_preferences(examples, pad_token_id=tokenizer.pad_token_id)
    sums = reward_model_loss(model, batch)
    ours = sums.loss.item() / batch.n_pairs

    # By hand: each sequence alone, unpadded, the score at its last token; -log σ(r_w - r_l - m) in float64.
    def score(ids: list[int]) -> float:
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])

    hand, correct = [], 0
    for e in examples:
        chosen, rejected = score(e.prompt_ids + e.chosen_ids), score(e.prompt_ids + e.rejected_ids)
        hand.append(math.log1p(math.exp(-(chosen - rejected - e.margin))))
        correct += chosen > rejected
    assert ours == pytest.approx(sum(hand) / len(hand), abs=1e-5)
    assert sums.metrics["accuracy"] == correct

    # TRL 1.16's RewardTrainer.compute_loss on the same model and batch (its loop state stubbed out).
    trainer = SimpleNamespace(
        model=model,
        args=SimpleNamespace(center_rewards_coefficient=None),
        accelerator=SimpleNamespace(gather_for_metrics=lambda x: x, gather=lambda x: x),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "margin": batch.margins}
    trl_loss = RewardTrainer.compute_loss(trainer, model, inputs)
    assert ours == pytest.approx(float(trl_loss), abs=1e-5)
    assert trainer._metrics["eval"]["accuracy"][-1] == pytest.approx(correct / len(examples))

    no_margin = pairwise_loss(torch.tensor([2.0]), torch.tensor([1.0])).item()
    assert no_margin == pytest.approx(math.log1p(math.exp(-1.0)))


def test_reward_model_learns_and_exports_a_scorer(
    make_config: Callable[..., RewardModelConfig],
) -> None:
    rows = separable_rows(32)
    config = make_config(use_lora=True, learning_rate=1e-2, max_steps=12, batch_size=4, n_epochs=2)
    rec = Recorder()
    result = train_reward_model(config, rows[:24], rows[24:], rec)
    assert rec.losses[-1] < rec.losses[0] - 0.3, rec.losses
    assert rec.evals[-1]["valid_accuracy"] >= 0.9
    assert min(row["accuracy"] for row in rec.steps[-3:]) >= 0.9
    assert {"accuracy", "rewards/chosen", "rewards/rejected", "rewards/margins"} <= set(rec.steps[-1])

    assert result.final_checkpoint is not None and result.final_checkpoint.final
    model_dir = result.final_checkpoint.path / "model"
    assert not (model_dir / "adapter_config.json").exists()  # merged: no peft needed
    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None

    held_out = separable_rows(8, offset=100)
    score = load_reward_scorer(model_dir, batch_size=3)
    prompts = [r["prompt"] for r in held_out]
    chosen = score(prompts, [r["chosen"] for r in held_out])
    rejected = score(prompts, [r["rejected"] for r in held_out])
    assert sum(c > r for c, r in zip(chosen, rejected, strict=True)) >= 7
    # Batching and padding do not change a score.
    assert score(prompts[:1], [held_out[0]["chosen"]])[0] == pytest.approx(chosen[0], abs=1e-5)
    grader_scores_the_training_pairs_as_the_reward_model_does(model_dir, rows[:8])


def as_chat(row: dict[str, Any]) -> dict[str, Any]:
    """The same pair in OpenAI's chat format."""
    return {
        "input": {"messages": [{"role": "user", "content": row["prompt"]}]},
        "preferred_output": [{"role": "assistant", "content": row["chosen"]}],
        "non_preferred_output": [{"role": "assistant", "content": row["rejected"]}],
    }


def grader_scores_the_training_pairs_as_the_reward_model_does(
    model_dir: Path, rows: list[dict[str, Any]]
) -> None:
    """A PPO/GRPO job's ``score_model`` grader sees a prompt as the rollout renders it (BOS + text, or the
    chat template with its generation prompt) and the generated text; it must score a training pair
    exactly as the reward model's own training forward pass does, for string and chat rows."""
    tokenizer = load_tokenizer(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    grader = build_grader({"type": "score_model", "name": "rm", "model": str(model_dir)})
    rl_rows = {
        "string": [{"prompt": r["prompt"]} for r in rows],
        "chat": [{"messages": [{"role": "user", "content": r["prompt"]}]} for r in rows],
    }
    for fmt, pairs in (("string", rows), ("chat", [as_chat(r) for r in rows])):
        examples = tokenize_preference_rows(pairs, tokenizer, max_length=1024)
        batch = collate_preferences(examples, pad_token_id=tokenizer.pad_token_id)
        with torch.no_grad():
            own = reward_scores(model, batch.input_ids, batch.attention_mask)  # chosen rows, then rejected
        prompts = [p.text for p in tokenize_rl_rows(rl_rows[fmt], tokenizer, max_prompt_length=1024)]
        completions = [r["chosen"] for r in rows] + [r["rejected"] for r in rows]
        graded = grader(prompts * 2, completions)
        assert graded == pytest.approx(own.tolist(), abs=1e-5), fmt


def test_lora_resume_restores_the_score_head(
    make_config: Callable[..., RewardModelConfig], tmp_path: Path
) -> None:
    rows = separable_rows(8)
    run = {"batch_size": 2, "max_steps": 4, "save_steps": 2, "learning_rate": 1e-2, "lora_dropout": 0.1}
    full = Recorder()
    train_reward_model(make_config(**run, output_dir=str(tmp_path / "a")), rows, callbacks=full)
    resumed = Recorder()
    mid = str(full.checkpoints[0].path)
    train_reward_model(
        make_config(**run, output_dir=str(tmp_path / "b"), resume_from=mid), rows, callbacks=resumed
    )
    assert resumed.losses == pytest.approx(full.losses[2:], abs=1e-5)
