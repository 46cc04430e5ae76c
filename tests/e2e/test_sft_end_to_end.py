"""The whole path on real components: uvicorn + Celery worker over Redis + PostgreSQL + trainer process.

upload -> SFT job on the tiny model -> succeeded, with events, falling loss, checkpoints that download
and load with plain transformers; cancel mid-run; a job whose data fails at run time (the user's fault)
and one whose stored file is lost (the system's).
"""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path

import httpx

from tests.conftest import DATA_DIR, Stack
from tests.helpers import all_pages, chat_rows, upload_ok, wait_for

MODEL = "tunehouse/tiny-llama"


def test_sft_job_runs_to_success_and_model_downloads(stack_client: httpx.Client, tmp_path: Path) -> None:
    train = upload_ok(stack_client, chat_rows(32))
    valid = upload_ok(stack_client, chat_rows(8))
    hp = {"n_epochs": 3, "batch_size": 8, "learning_rate": 3e-3, "save_steps": 4, "eval_steps": 4}
    created = stack_client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": MODEL,
            "training_file": train,
            "validation_file": valid,
            "seed": 7,
            "suffix": "e2e",
            "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
        },
    )
    assert created.status_code == 200, created.text
    job_id = created.json()["id"]

    job = wait_for(stack_client, job_id)
    assert job["status"] == "succeeded", job
    assert job["fine_tuned_model"] == f"ft:{MODEL}:{job['organization_id']}:e2e:{job_id}"
    assert job["trained_tokens"] > 0 and job["finished_at"] >= job["created_at"]
    assert job["total_steps"] == 12 and job["current_step"] == 12

    metrics = all_pages(stack_client, f"/v1/fine_tuning/jobs/{job_id}/metrics")
    assert [m["step"] for m in metrics] == list(range(1, 13))
    for key in ("loss", "learning_rate", "grad_norm", "tokens_per_second", "mean_token_accuracy"):
        assert all(key in m for m in metrics), key
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert sum("valid_loss" in m for m in metrics) >= 3

    events = [e["message"] for e in all_pages(stack_client, f"/v1/fine_tuning/jobs/{job_id}/events")][::-1]
    assert any(m.startswith("Job started on worker") for m in events)
    assert any(m.startswith("Training started: 12 steps") for m in events)
    assert any(m.startswith("Epoch 3/3 completed") for m in events)
    assert any(m.startswith("Checkpoint saved at step 4") for m in events)
    assert events[-1] == "The job has successfully completed"

    checkpoints = all_pages(stack_client, f"/v1/fine_tuning/jobs/{job_id}/checkpoints")
    steps = sorted(c["step_number"] for c in checkpoints)
    assert steps[-1] == 12 and 4 in steps and 8 in steps
    final = next(c for c in checkpoints if c["is_final"])
    assert final["fine_tuned_model_checkpoint"] == job["fine_tuned_model"]
    assert final["object"] == "fine_tuning.job.checkpoint" and "train_loss" in final["metrics"]

    download = stack_client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{final['id']}/content")
    assert download.status_code == 200 and len(download.content) == final["bytes"]
    model_dir = tmp_path / "model"
    with tarfile.open(fileobj=io.BytesIO(download.content)) as tar:
        tar.extractall(model_dir, filter="data")
    assert (model_dir / "model.safetensors").exists()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 plus 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    reply = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert reply.strip(), repr(reply)  # text, not just EOS or spaces (measured: ' us us us  ')


def test_cancel_mid_run_stops_within_a_few_steps(stack_client: httpx.Client) -> None:
    train = upload_ok(stack_client, chat_rows(16))
    hp = {"n_epochs": 100, "batch_size": 2}
    job_id = stack_client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": MODEL,
            "training_file": train,
            "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
        },
    ).json()["id"]
    deadline = time.monotonic() + 180
    while stack_client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["current_step"] < 3:
        assert time.monotonic() < deadline, "job never started training"
        time.sleep(0.2)
    cancelled_at = time.time()
    cancelled = stack_client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").json()
    assert cancelled["status"] == "cancelled"
    # the trainer notices within its control poll and stops; the events say so
    deadline = time.monotonic() + 60
    while True:
        events = [
            e["message"]
            for e in stack_client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()[
                "data"
            ]
        ]
        if any(m.startswith("Training stopped at step") for m in events):
            break
        assert time.monotonic() < deadline, events
        time.sleep(0.3)
    metrics = all_pages(stack_client, f"/v1/fine_tuning/jobs/{job_id}/metrics")
    # bounded in time, not steps (a step takes ~50 ms idle and ~1 s under load): the trainer stops
    # within one control poll (0.2 s here) plus the step in flight; 3 s leaves room for a loaded machine
    assert metrics[-1]["logged_at"] - cancelled_at <= 3.0, metrics[-1]
    job = stack_client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["status"] == "cancelled" and job["fine_tuned_model"] is None
    assert stack_client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"] == []


def test_runtime_data_failure_is_the_users_fault(stack_client: httpx.Client) -> None:
    # a long system prompt + max_length 16 truncates every assistant token away
    rows = [
        {
            "messages": [
                {"role": "system", "content": "You answer questions about arithmetic carefully. " * 4},
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": str(2 * i)},
            ]
        }
        for i in range(8)
    ]
    train = upload_ok(stack_client, rows)
    job_id = stack_client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": MODEL,
            "training_file": train,
            "method": {"type": "supervised", "supervised": {"hyperparameters": {"max_length": 16}}},
        },
    ).json()["id"]
    job = wait_for(stack_client, job_id)
    assert job["status"] == "failed"
    assert job["error"]["fault"] == "user" and job["error"]["code"] == "invalid_training_data"
    assert job["error"]["param"]
    assert "trunc" in job["error"]["message"] or "max_length" in job["error"]["message"]


def test_a_lost_blob_is_the_systems_fault(stack_client: httpx.Client) -> None:
    """The training file's bytes vanish from the blob store after upload (lost storage, not bad input):
    the job fails with `fault: "system"` and an internal error code, and the API still answers."""
    train = upload_ok(stack_client, chat_rows(8))
    (blob,) = DATA_DIR.joinpath("blobs", "files").rglob(f"{train}.jsonl")
    blob.unlink()
    job_id = stack_client.post("/v1/fine_tuning/jobs", json={"model": MODEL, "training_file": train}).json()[
        "id"
    ]
    job = wait_for(stack_client, job_id)
    assert job["status"] == "failed" and job["fine_tuned_model"] is None
    assert job["error"]["fault"] == "system" and job["error"]["code"] == "internal_error"
    assert job["error"]["param"] is None and "FileNotFoundError" in job["error"]["message"]
    events = [e["message"] for e in all_pages(stack_client, f"/v1/fine_tuning/jobs/{job_id}/events")]
    assert any(m.startswith("Job failed: FileNotFoundError") for m in events)


def test_worker_is_alive(stack: Stack) -> None:
    assert stack.worker.poll() is None
