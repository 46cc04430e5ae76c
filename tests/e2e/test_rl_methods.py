"""GRPO, OpenAI's `reinforcement`, PPO, RLOO and online DPO jobs through API + Celery worker on
PostgreSQL/Redis, with graders declared in the job (string_check, and a reward model trained by an earlier
job as a score_model, inside a multi grader for PPO and as online DPO's judge)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import Stack, new_key
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
    # measured (seed 1): mean reward 0.42 over the first 4 steps, 0.70 over the last 4, 0.875 at the end
    assert _mean(metrics[-4:], "reward") > _mean(metrics[:4], "reward") + 0.2, metrics
    assert metrics[-1]["reward"] >= 0.75


def test_reinforcement_runs_grpo_with_its_grader(stack_client: httpx.Client) -> None:
    hp = {**RL_HP, "num_generations": 2, "max_steps": 2, "beta": 0.04}
    job, metrics = _run(
        stack_client, {"type": "reinforcement", "reinforcement": {"grader": HAS_E, "hyperparameters": hp}}
    )
    assert [m["step"] for m in metrics] == [1, 2] and "kl" in metrics[-1]
    assert job["fine_tuned_model"].startswith("ft:")


@pytest.fixture(scope="module")
def rm_tenant(stack: Stack) -> Iterator[tuple[httpx.Client, str]]:
    """A tenant's client and the name of a reward model it trained (a `reward_model` job), once for the
    tests that grade with it."""
    headers = {"Authorization": f"Bearer {new_key()}"}
    with httpx.Client(base_url=stack.url, headers=headers, timeout=60) as client:
        pref = upload_ok(client, preference_rows(8, openai_shape=False))
        method = {
            "type": "reward_model",
            "reward_model": {"hyperparameters": {"n_epochs": 1, "batch_size": 4}},
        }
        rm = client.post(
            "/v1/fine_tuning/jobs", json={"model": MODEL, "training_file": pref, "method": method}
        )
        assert rm.status_code == 200, rm.text
        job = wait_for(client, rm.json()["id"])
        assert job["status"] == "succeeded", job
        yield client, str(job["fine_tuned_model"])


def test_ppo_with_a_reward_model_and_a_string_check(rm_tenant: tuple[httpx.Client, str]) -> None:
    client, rm_model = rm_tenant
    grader = {
        "type": "multi",
        "graders": {"e": HAS_E, "rm": {"type": "score_model", "name": "rm", "model": rm_model}},
        "calculate_output": "e + 0.1 * rm",
    }
    hp = {**RL_HP, "max_steps": 8, "n_epochs": 4, "num_ppo_epochs": 2}
    _, metrics = _run(client, {"type": "ppo", "ppo": {"grader": grader, "hyperparameters": hp}})
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


def test_rloo_with_a_string_check(stack_client: httpx.Client) -> None:
    hp = {**RL_HP, "num_generations": 4, "max_steps": 4, "n_epochs": 1, "beta": 0.05}
    job, metrics = _run(stack_client, {"type": "rloo", "rloo": {"grader": HAS_E, "hyperparameters": hp}})
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for key in ("reward", "reward_std", "rewards/has_e/mean", "kl", "clip_ratio", "entropy"):
        assert key in metrics[-1], key
    assert metrics[0]["kl"] == 0.0  # the policy starts at the reference
    assert job["fine_tuned_model"].startswith("ft:")


def test_online_dpo_judged_by_a_tenant_reward_model(rm_tenant: tuple[httpx.Client, str]) -> None:
    client, rm_model = rm_tenant
    grader = {"type": "score_model", "name": "rm", "model": rm_model}
    hp = {**RL_HP, "batch_size": 8, "max_steps": 4, "n_epochs": 2}
    job, metrics = _run(
        client, {"type": "online_dpo", "online_dpo": {"grader": grader, "hyperparameters": hp}}
    )
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    # a reward model's scores are continuous: every pair is ordered, and y_w scored higher than y_l
    assert all(m["frac_pairs_judged"] == 1.0 and m["scores_margin"] > 0 for m in metrics)
    for key in ("rewards/rm/mean", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"):
        assert key in metrics[-1], key
    assert job["fine_tuned_model"].startswith("ft:")
