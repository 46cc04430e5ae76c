"""The shared RL plumbing (trainers/families/rl.py): one reward set for every RL method of the registry.

A reward function may return None for a completion it cannot judge; every RL method then trains on,
counts it per reward function (``rewards/{name}/unscored``), and takes no reward signal from it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainers.helpers import Recorder, small_config
from trainers.core.errors import DataError
from trainers.data.example_store import ExampleStore
from trainers.families.rl import completion_metrics, reward_evaluator
from trainers.families.rollout import tokenize_rl_rows
from trainers.methods.grpo import GRPOConfig, train_grpo
from trainers.registry import METHODS, resolve
from trainers.rewards.graders import build_grader
from trainers.rewards.reward_set import RewardSet

RL_METHODS = [n for n, m in METHODS.items() if m.grader and n != "reinforcement"]  # reinforcement is GRPO
ROWS = [{"prompt": p, "answer": "e"} for p in ("The capital of Peru is", "Hello", "Name a color:")] * 4


class Judge:
    """Scores 1.0 when a completion holds an "e", 0.0 when not; None for every ``skip``-th completion
    (all of them with ``skip=1``). Remembers how many Nones each call returned."""

    __name__ = "judge"

    def __init__(self, skip: int) -> None:
        self.skip, self.nones = skip, []

    def __call__(
        self, prompts: list[str], completions: list[str], **columns: list[Any]
    ) -> list[float | None]:
        scores = [None if i % self.skip == 0 else float("e" in c) for i, c in enumerate(completions)]
        self.nones.append(scores.count(None))
        return scores


def test_reward_set_weights_names_and_none() -> None:
    def half(prompts: list[str], completions: list[str], **_: Any) -> list[float | None]:
        return [None, 2.0, None]

    def ones(prompts: list[str], completions: list[str], **_: Any) -> list[float | None]:
        return [1.0, 1.0, None]

    scores = RewardSet.of([half, ones], weights=[0.5, 3.0]).score(["q"] * 3, ["a", "b", "c"], {})
    assert scores.per_func[:, 0].isnan().tolist() == [True, False, True]
    assert scores.total[:2].tolist() == [3.0, 4.0] and math.isnan(scores.total[2])  # nobody judged "c"
    assert scores.scored.tolist() == [True, True, False]
    assert scores.metrics() == {
        "rewards/half/mean": 2.0,
        "rewards/half/unscored": 2.0,
        "rewards/ones/mean": 1.0,
        "rewards/ones/unscored": 1.0,
    }


def test_reward_set_checks_its_functions() -> None:
    with pytest.raises(DataError):
        RewardSet.of([])
    with pytest.raises(ValueError, match="one entry per reward function"):
        RewardSet.of([Judge(2)], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="returned 1 scores for 2 completions"):
        RewardSet.of([lambda p, c: [1.0]]).score(["q", "q"], ["a", "b"], {})


def test_completion_metrics() -> None:
    m = completion_metrics(torch.tensor([2, 1]), torch.tensor([False, False]))
    assert (m["completions/min_length"], m["completions/max_length"], m["completions/clipped_ratio"]) == (
        1,
        2,
        0,
    )


@pytest.mark.parametrize("name", RL_METHODS)
def test_some_unscored_completions_are_counted_and_training_goes_on(
    name: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    judge, rec = Judge(skip=2), Recorder()
    config = small_config(name, tiny_model_path, tmp_path, max_steps=2, batch_size=4)
    resolve(METHODS[name].trainer)(config, ROWS, None, rec, rewards=RewardSet.of([judge]))
    assert [row["rewards/judge/unscored"] for row in rec.steps] == judge.nones and min(judge.nones) > 0
    for row in rec.steps:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
        assert 0.0 <= row["rewards/judge/mean"] <= 1.0


@pytest.mark.parametrize("name", RL_METHODS)
def test_a_grader_that_judges_nothing_trains_nothing(
    name: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    judge, rec = Judge(skip=1), Recorder()
    # PPO's missing-EOS penalty is part of the score: an unscored completion does not pay it either
    config = small_config(name, tiny_model_path, tmp_path, max_steps=2, missing_eos_penalty=1.0)
    resolve(METHODS[name].trainer)(config, ROWS, None, rec, rewards=RewardSet.of([judge]))
    assert [row["grad_norm"] for row in rec.steps] == [0.0, 0.0]
    assert [row["rewards/judge/unscored"] for row in rec.steps] == judge.nones


# -- validation: the policy's completions of the validation prompts, graded -------------------------------
VALID_ROWS = [
    {"prompt": "The capital of Peru is", "answer": "e", "bonus": 1.0},
    {"prompt": "Hello", "answer": "e", "bonus": 0.0},
    {"prompt": "Name a color:", "answer": "e", "bonus": 3.0},
]
HAS_E = {
    "type": "string_check",
    "name": "has_e",
    "operation": "like",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
}


class Seen:
    """A reward function that returns each row's ``bonus`` (rows without one: 1.0 for a completion with
    an "e") and remembers the completions it was given."""

    __name__ = "bonus"

    def __init__(self) -> None:
        self.completions: list[str] = []

    def __call__(self, prompts: list[str], completions: list[str], **columns: list[Any]) -> list[float]:
        self.completions += completions
        bonus = columns.get("bonus", [None] * len(completions))
        return [float("e" in c) if b is None else float(b) for c, b in zip(completions, bonus, strict=True)]


def _greedy_one_by_one(model: Any, tokenizer: Any, rows: list[dict[str, Any]], budget: int) -> list[str]:
    """The reference: each prompt generated alone (no padding, no batching) with plain greedy decoding."""
    out = []
    for p in tokenize_rl_rows(rows, tokenizer, max_prompt_length=512):
        ids = torch.tensor([p.input_ids])
        new = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=budget,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )[0, ids.size(1) :]
        out.append(tokenizer.decode(new, skip_special_tokens=True))
    return out


def test_validation_grades_the_greedy_completions_of_the_policy(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    config = GRPOConfig(str(tiny_model_path), str(tmp_path), batch_size=2, max_completion_length=6)
    seen = Seen()
    rewards = RewardSet.of([build_grader(HAS_E), seen], weights=[1.0, 0.5], names=["has_e", "bonus"])
    evaluate = reward_evaluator(config, tokenizer, VALID_ROWS, rewards)
    assert evaluate is not None
    rng = torch.get_rng_state()
    metrics = evaluate(model)

    expected = _greedy_one_by_one(model, tokenizer, VALID_ROWS, budget=6)
    assert seen.completions == expected  # batches of 2 prompts, left-padded: the same greedy text
    has_e = [float("e" in c) for c in expected]
    bonus = [1.0, 0.0, 3.0]
    assert metrics == pytest.approx(
        {
            "valid_reward": sum(h + 0.5 * b for h, b in zip(has_e, bonus, strict=True)) / 3,
            "valid_reward/has_e": sum(has_e) / 3,
            "valid_reward/bonus": 4.0 / 3,
        }
    )
    assert torch.equal(torch.get_rng_state(), rng)  # training draws the same rollouts with validation
    assert reward_evaluator(config, tokenizer, [], rewards) is None


def test_sampled_validation_repeats_its_draws_and_skips_what_nobody_scored(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    config = GRPOConfig(
        str(tiny_model_path), str(tmp_path), max_completion_length=8, eval_sampling="sample", seed=3
    )
    first, again = Seen(), Seen()
    for seen in (first, again):
        evaluate = reward_evaluator(config, tokenizer, VALID_ROWS, RewardSet.of([seen, Judge(skip=1)]))
        assert evaluate is not None
        # the judge scores nothing: its mean is absent, the total is the bonus alone
        assert evaluate(model) == pytest.approx({"valid_reward": 4.0 / 3, "valid_reward/bonus": 4.0 / 3})
    assert first.completions == again.completions  # every sampled pass starts from config.seed
    assert first.completions != _greedy_one_by_one(model, tokenizer, VALID_ROWS, budget=8)


def test_validation_rows_are_checked_before_training(tiny_model_path: Path, tmp_path: Path) -> None:
    config = GRPOConfig(str(tiny_model_path), str(tmp_path), max_steps=1)
    with pytest.raises(DataError) as info:
        train_grpo(config, ROWS, [{"prompt": "ok"}, {"text": "no prompt"}], rewards=RewardSet.of([Judge(2)]))
    assert info.value.param == "validation_file" and "line 2" in info.value.message


def test_grpo_validates_at_eval_steps_and_at_the_end_without_changing_training(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    def run(valid: list[dict[str, Any]] | None, out: str) -> Recorder:
        rec = Recorder()
        config = small_config("grpo", tiny_model_path, tmp_path / out, max_steps=3, eval_steps=2)
        train_grpo(config, ROWS, valid, rec, rewards=RewardSet.of([Seen()]))
        return rec

    with_valid, without = run(VALID_ROWS, "a"), run(None, "b")
    assert [row["step"] for row in with_valid.evals] == [2.0, 3.0] and without.evals == []
    assert [row["valid_reward"] for row in with_valid.evals] == pytest.approx([4.0 / 3, 4.0 / 3])
    assert with_valid.losses == without.losses
    assert [r["reward"] for r in with_valid.steps] == [r["reward"] for r in without.steps]
    # the final checkpoint's metrics carry the last validation, apart from the training reward
    final = with_valid.checkpoints[-1]
    assert final.final and final.metrics["valid_reward/bonus"] == pytest.approx(4.0 / 3)
    assert final.metrics["reward"] == with_valid.steps[-1]["reward"]


def test_rl_prompts_are_kept_on_disk_and_come_back_whole(tokenizer: Any) -> None:
    rows = [{"prompt": "Où est Lima ?", "answer": "Pérou", "meta": {"k": [1, 2.5, None]}}, {"prompt": "b"}]
    prompts = tokenize_rl_rows(rows, tokenizer, max_prompt_length=64)
    assert isinstance(prompts, ExampleStore) and len(prompts) == 2
    assert prompts[0].columns == {"answer": "Pérou", "meta": {"k": [1, 2.5, None]}}
    assert prompts[0].text.endswith("Où est Lima ?") and prompts[1].columns == {}
    assert prompts[0].input_ids == tokenizer(prompts[0].text, add_special_tokens=False)["input_ids"]


def test_an_rl_row_field_that_is_not_json_is_refused_with_its_line(tokenizer: Any) -> None:
    rows = [{"prompt": "a"}, {"prompt": "b", "when": object()}]
    with pytest.raises(DataError, match=r"^line 2: the row's fields must be JSON values") as caught:
        tokenize_rl_rows(rows, tokenizer, max_prompt_length=64)
    assert caught.value.param == "training_file"


def test_a_rollout_stops_at_any_token_the_model_ends_a_turn_with(
    tiny_model_path: Path, tokenizer: Any, tmp_path: Path
) -> None:
    """Sampling stops at the generation config's stop tokens as well as the tokenizer's EOS (gpt-oss ends
    a tool call with <|call|>, which is not its EOS): a completion ends at the first, kept and not
    truncated, and nothing after it trains."""
    from transformers import AutoModelForCausalLM

    from trainers.families.rollout import generate_rollout

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    call = tokenizer.convert_tokens_to_ids("<|system|>")  # a special token the prompts never hold
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, call]
    with torch.no_grad():
        model.lm_head.weight[call] += 1.5  # likely within a few tokens
    prompts = tokenize_rl_rows([{"prompt": "Hi there"}], tokenizer, max_prompt_length=64)
    rollout = generate_rollout(model, tokenizer, prompts, num_generations=4, max_completion_length=24, seed=0)
    ended = []
    for ids, mask, cut in zip(
        rollout.completion_ids, rollout.completion_mask, rollout.truncated, strict=True
    ):
        kept = ids[mask.bool()].tolist()
        assert call not in kept[:-1]  # nothing is sampled past the stop token
        ended.append(not bool(cut) and kept[-1] == call)
    assert any(ended)
