"""DPO and reward-model jobs through API + Celery worker on PostgreSQL/Redis, on the same machinery as
SFT; a fine-tuned model is the base of a later job; a reward model's export loads as a classifier."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import all_pages, chat_rows, upload_ok, wait_for

MODEL = "tunehouse/tiny-llama"


def preference_rows(n: int = 16, *, openai_shape: bool = True) -> list[dict[str, Any]]:
    """Separable pairs: the preferred answer is polite, the other rude."""
    rows: list[dict[str, Any]] = []
    for i in range(n):
        question = f"What is {i} plus {i}?"
        good, bad = f"Happy to help: {2 * i}.", f"Go away. {2 * i + 1}."
        if openai_shape:
            rows.append(
                {
                    "input": {"messages": [{"role": "user", "content": question}]},
                    "preferred_output": [{"role": "assistant", "content": good}],
                    "non_preferred_output": [{"role": "assistant", "content": bad}],
                }
            )
        else:
            rows.append({"prompt": question, "chosen": good, "rejected": bad})
    return rows


def _run(client: httpx.Client, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    created = client.post("/v1/fine_tuning/jobs", json=body)
    assert created.status_code == 200, created.text
    job = wait_for(client, created.json()["id"])
    assert job["status"] == "succeeded", job
    metrics = all_pages(client, f"/v1/fine_tuning/jobs/{job['id']}/metrics")
    print(
        f"\n{body['method']['type']}: first {metrics[0]}\n{body['method']['type']}: last {metrics[-1]}"
    )  # `-s` shows it
    return job, metrics


def _download_final(client: httpx.Client, job_id: str, dest: Path) -> Path:
    final = next(c for c in all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/checkpoints") if c["is_final"])
    content = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{final['id']}/content").content
    with tarfile.open(fileobj=io.BytesIO(content)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def test_dpo_job_on_a_fine_tuned_model(stack_client: httpx.Client) -> None:
    sft_file = upload_ok(stack_client, chat_rows(8))
    sft, _ = _run(
        stack_client,
        {
            "model": MODEL,
            "training_file": sft_file,
            "suffix": "base",
            "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1}}},
        },
    )
    models = [m["id"] for m in stack_client.get("/v1/models").json()["data"]]
    assert sft["fine_tuned_model"] in models

    pref = upload_ok(stack_client, preference_rows())
    hp = {"n_epochs": 4, "batch_size": 4, "learning_rate": 5e-3, "beta": 0.5, "save_steps": 8}
    job, metrics = _run(
        stack_client,
        {
            "model": sft["fine_tuned_model"],
            "training_file": pref,
            "method": {"type": "dpo", "dpo": {"hyperparameters": hp}},
        },
    )
    assert [m["step"] for m in metrics] == list(range(1, 17))
    for key in (
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ):
        assert key in metrics[-1], key
    assert metrics[-1]["rewards/margins"] > metrics[0]["rewards/margins"]
    assert metrics[-1]["rewards/accuracies"] >= 0.75
    assert job["method"]["dpo"]["hyperparameters"]["beta"] == 0.5
    assert job["fine_tuned_model"].startswith(f"ft:{MODEL}:") and job["model"] == sft["fine_tuned_model"]


def test_reward_model_job_exports_a_classifier(stack_client: httpx.Client, tmp_path: Path) -> None:
    pref = upload_ok(stack_client, preference_rows(openai_shape=False))
    hp = {"n_epochs": 4, "batch_size": 4, "learning_rate": 3e-3}
    job, metrics = _run(
        stack_client,
        {
            "model": MODEL,
            "training_file": pref,
            "method": {"type": "reward_model", "reward_model": {"hyperparameters": hp}},
        },
    )
    assert "accuracy" in metrics[-1] and metrics[-1]["loss"] < metrics[0]["loss"]
    # a reward model is not a base for further training
    assert job["fine_tuned_model"] not in [m["id"] for m in stack_client.get("/v1/models").json()["data"]]

    from transformers import AutoModelForSequenceClassification

    folder = _download_final(stack_client, job["id"], tmp_path / "rm")
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    assert model.config.num_labels == 1
