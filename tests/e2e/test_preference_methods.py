"""DPO, ORPO, CPO, SimPO, KTO and reward-model jobs through API + Celery worker on PostgreSQL/Redis, on the
same machinery as SFT; a fine-tuned model is the base of a later job; a reward model's export loads as a
classifier; KTO's unpaired feedback files are checked at upload."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import all_pages, chat_rows, jsonl, tenant_of, upload, upload_ok, wait_for

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


def feedback_rows(n: int = 16) -> list[dict[str, Any]]:
    """KTO's unpaired feedback: each prompt answered once, politely (desirable) or rudely (undesirable)."""
    rows: list[dict[str, Any]] = []
    for row in preference_rows(n, openai_shape=False):
        good = len(rows) % 2 == 0
        answer = row["chosen"] if good else row["rejected"]
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages, "label": good})
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


def test_a_dpo_sweep_reads_the_reference_log_probs_an_earlier_job_kept_with_its_file(
    stack_client: httpx.Client, api_key: str
) -> None:
    """Two DPO jobs on one file with precomputed reference log-probs: the first keeps them in the blob
    store next to the file, the second (another β) reads them instead of scoring the pairs again and
    says so in its events; deleting the file deletes them."""
    from service.files.service import reference_log_probs_key
    from service.storage import get_blob_store

    pref = upload_ok(stack_client, preference_rows())

    def job(beta: float) -> dict[str, Any]:
        hp = {"n_epochs": 1, "batch_size": 4, "beta": beta, "precompute_ref_log_probs": True}
        body = {
            "model": MODEL,
            "training_file": pref,
            "method": {"type": "dpo", "dpo": {"hyperparameters": hp}},
        }
        done, _ = _run(stack_client, body)
        return done

    def reference_events(job_id: str) -> list[str]:
        events = all_pages(stack_client, f"/v1/fine_tuning/jobs/{job_id}/events")
        return [e["message"] for e in events if "reference log-probs" in e["message"].lower()]

    first = job(0.1)
    key = reference_log_probs_key(tenant_of(api_key), pref)
    assert get_blob_store().size(key) > 0
    assert reference_events(first["id"]) == [
        "Computing the reference log-probs of 16 pairs before training (precompute_ref_log_probs)"
    ]
    second = job(0.3)
    assert reference_events(second["id"]) == [
        "Reference log-probs of 16 pairs reused from an earlier run on the same pairs"
    ]
    assert stack_client.delete(f"/v1/files/{pref}").status_code == 200
    with pytest.raises(FileNotFoundError):
        get_blob_store().size(key)


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
    # a LoRA reward model trains on a shared base like any LoRA job (its classifier on the causal LM,
    # trainers/modeling/adapter_classifier.py), and its download is a plain classifier all the same
    events = [e["message"] for e in all_pages(stack_client, f"/v1/fine_tuning/jobs/{job['id']}/events")]
    assert any("sharing one copy of its base model" in m for m in events), events
    # a reward model is not a base for further training
    assert job["fine_tuned_model"] not in [m["id"] for m in stack_client.get("/v1/models").json()["data"]]

    from transformers import AutoModelForSequenceClassification

    folder = _download_final(stack_client, job["id"], tmp_path / "rm")
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    assert model.config.num_labels == 1


# one job per reference-free preference method; the learning rates are the tiny model's, tuned for 8 steps
PAIR_METHODS = {
    "orpo": {"beta": 0.5},
    "cpo": {"beta": 0.1, "cpo_alpha": 0.5},
    "simpo": {"beta": 2.0, "simpo_gamma": 1.0},
}


@pytest.mark.parametrize("method", PAIR_METHODS)
def test_reference_free_preference_job(stack_client: httpx.Client, method: str) -> None:
    pref = upload_ok(stack_client, preference_rows(openai_shape=method != "cpo"))
    hp = {"n_epochs": 2, "batch_size": 4, "learning_rate": 5e-3, **PAIR_METHODS[method]}
    job, metrics = _run(
        stack_client,
        {"model": MODEL, "training_file": pref, "method": {"type": method, method: {"hyperparameters": hp}}},
    )
    assert [m["step"] for m in metrics] == list(range(1, 9))
    for key in (
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "nll_loss",
    ):
        assert key in metrics[-1], key
    assert metrics[-1]["rewards/margins"] > metrics[0]["rewards/margins"]
    assert job["method"][method]["hyperparameters"]["beta"] == hp["beta"]
    assert job["trained_tokens"] > 0


def test_kto_job_on_unpaired_feedback(stack_client: httpx.Client) -> None:
    # malformed feedback is refused at upload, naming the line and field
    bad = upload(stack_client, jsonl([*feedback_rows(2), {**feedback_rows(1)[0], "label": "yes"}]))
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["message"].startswith("line 3: field 'label': expected true or false")
    # an SFT file is not feedback (preference pairs are: each gives a desirable and an undesirable example)
    sft = upload_ok(stack_client, chat_rows(4))
    wrong = stack_client.post(
        "/v1/fine_tuning/jobs", json={"model": MODEL, "training_file": sft, "method": {"type": "kto"}}
    )
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "training_file", wrong.text

    feedback = upload_ok(stack_client, feedback_rows())
    hp = {"n_epochs": 2, "batch_size": 4, "learning_rate": 5e-3, "beta": 0.5, "undesirable_weight": 1.2}
    job, metrics = _run(
        stack_client,
        {
            "model": MODEL,
            "training_file": feedback,
            "method": {"type": "kto", "kto": {"hyperparameters": hp}},
        },
    )
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert {"loss", "kl"} <= set(metrics[-1])
    # a side's metrics are left out of a step with none of its examples (the data order is random here,
    # and a micro-batch of 4 has no desirable example 1 time in 26), so look over every step
    assert {"logps/chosen", "logps/rejected"} <= set().union(*metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    # σ(0) = 0.5 at the start: 0.5 per desirable example, 0.5 x 1.2 per undesirable one, so between 0.5
    # (a first micro-batch all desirable) and 0.6 (all undesirable); the random order decides the mix
    assert 0.5 - 1e-3 <= metrics[0]["loss"] <= 0.6 + 1e-3
    assert job["method"]["kto"]["hyperparameters"]["undesirable_weight"] == 1.2
