"""GRPO, OpenAI's `reinforcement` and PPO jobs through API + Celery worker on PostgreSQL/Redis, with
graders declared in the job (string_check, and a reward model trained by an earlier job as a
score_model inside a multi grader)."""

from __future__ import annotations

from typing import Any

import httpx

from tests.e2e.test_preference_methods import preference_rows
from tests.helpers import all_pages, upload_ok, wait_for

MODEL = "tunehouse/tiny-llama"
PROMPTS = ["The capital of Peru is", "Hello", "What is two plus two?", "Name a color:"]
# about half of the tiny model's 4-token samples contain an "e": a reachable, verifiable target
ROWS = [{"prompt": p, "answer": "e"} for p in PROMPTS] * 4
HAS_E = {
    "type": "string_check",
    "name": "has_e",
    "operation": "like",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
}
RL_HP = {
    "lora": False,
    "learning_rate": 1e-2,
    "batch_size": 4,
    "max_completion_length": 4,
    "lr_scheduler": "constant",
}


def _run(client: httpx.Client, method: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    train = upload_ok(client, ROWS)
    created = client.post(
        "/v1/fine_tuning/jobs", json={"model": MODEL, "training_file": train, "seed": 1, "method": method}
    )
    assert created.status_code == 200, created.text
    job = wait_for(client, created.json()["id"], timeout=300)
    assert job["status"] == "succeeded", job
    metrics = all_pages(client, f"/v1/fine_tuning/jobs/{job['id']}/metrics")
    print(f"\n{method['type']}: first {metrics[0]}\n{method['type']}: last {metrics[-1]}")
    return job, metrics


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(float(r[key]) for r in rows) / len(rows)


def test_grpo_reward_rises(stack_client: httpx.Client) -> None:
    hp = {**RL_HP, "num_generations": 4, "max_steps": 16, "n_epochs": 4}
    _, metrics = _run(stack_client, {"type": "grpo", "grpo": {"grader": HAS_E, "hyperparameters": hp}})
    for key in (
        "reward",
        "reward_std",
        "rewards/has_e/mean",
        "clip_ratio",
        "entropy",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
    ):
        assert key in metrics[-1], key
    assert _mean(metrics[-4:], "reward") > _mean(metrics[:4], "reward")


def test_reinforcement_runs_grpo_with_its_grader(stack_client: httpx.Client) -> None:
    hp = {**RL_HP, "num_generations": 2, "max_steps": 2, "beta": 0.04}
    job, metrics = _run(
        stack_client, {"type": "reinforcement", "reinforcement": {"grader": HAS_E, "hyperparameters": hp}}
    )
    assert [m["step"] for m in metrics] == [1, 2] and "kl" in metrics[-1]
    assert job["fine_tuned_model"].startswith("ft:")


def test_ppo_with_a_reward_model_and_a_string_check(stack_client: httpx.Client) -> None:
    pref = upload_ok(stack_client, preference_rows(8, openai_shape=False))
    rm = stack_client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": MODEL,
            "training_file": pref,
            "method": {
                "type": "reward_model",
                "reward_model": {"hyperparameters": {"n_epochs": 1, "batch_size": 4}},
            },
        },
    ).json()
    rm = wait_for(stack_client, rm["id"])
    assert rm["status"] == "succeeded", rm
    grader = {
        "type": "multi",
        "graders": {"e": HAS_E, "rm": {"type": "score_model", "name": "rm", "model": rm["fine_tuned_model"]}},
        "calculate_output": "e + 0.1 * rm",
    }
    hp = {**RL_HP, "max_steps": 8, "n_epochs": 4, "num_ppo_epochs": 2}
    _, metrics = _run(stack_client, {"type": "ppo", "ppo": {"grader": grader, "hyperparameters": hp}})
    for key in (
        "policy_loss",
        "value_loss",
        "approx_kl",
        "clip_fraction",
        "entropy",
        "kl",
        "score",
        "returns",
    ):
        assert key in metrics[-1], key
