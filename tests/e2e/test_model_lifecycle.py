"""After training, on the real stack (uvicorn + Celery worker + PostgreSQL + Redis): the job's result
file (OpenAI's step-metrics CSV), exact `trained_tokens`, `estimated_finish` while running, and deleting
the fine-tuned model (DELETE /v1/models/{name}), driven partly by the official `openai` client."""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import Stack, new_key
from tests.helpers import all_pages, chat_rows, upload_ok, wait_for

MODEL = "tunehouse/tiny-llama"
N_EPOCHS = 2
TRAIN_ROWS = chat_rows(8)


@dataclass
class Trained:
    key: str
    job: dict[str, Any]
    http: httpx.Client
    oai: openai.OpenAI


@pytest.fixture(scope="module")
def trained(stack: Stack) -> Iterator[Trained]:
    """One finished SFT job (4 steps, an evaluation and a checkpoint at step 2) shared by this module."""
    key = new_key()
    http = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    oai = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0)
    hp = {"n_epochs": N_EPOCHS, "batch_size": 4, "eval_steps": 2, "save_steps": 2}
    created = http.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": MODEL,
            "training_file": upload_ok(http, TRAIN_ROWS),
            "validation_file": upload_ok(http, chat_rows(4)),
            "suffix": "life",
            "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
        },
    )
    assert created.status_code == 200, created.text
    job = wait_for(http, created.json()["id"])
    assert job["status"] == "succeeded", job
    yield Trained(key, job, http, oai)
    http.close()
    oai.close()


def test_result_file_is_openais_step_metrics_csv(trained: Trained) -> None:
    job = trained.job
    assert len(job["result_files"]) == 1
    file = trained.oai.files.retrieve(job["result_files"][0])
    assert file.purpose == "fine-tune-results" and file.filename == "step_metrics.csv"
    listed = trained.http.get("/v1/files", params={"purpose": "fine-tune-results"}).json()["data"]
    assert [f["id"] for f in listed] == [file.id]

    content = trained.oai.files.content(file.id)
    assert content.response.headers["content-type"].startswith("text/csv")
    text = content.text
    assert len(text.encode()) == file.bytes
    table = list(csv.DictReader(io.StringIO(text)))
    header = text.splitlines()[0].split(",")
    assert header[:5] == ["step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy"]
    # the method's own metrics as extra columns
    assert {"epoch", "learning_rate", "grad_norm", "trained_tokens"} <= set(header[5:])
    assert "loss" not in header and "logged_at" not in header

    metrics = all_pages(trained.http, f"/v1/fine_tuning/jobs/{job['id']}/metrics")
    assert [int(r["step"]) for r in table] == [m["step"] for m in metrics] == [1, 2, 3, 4]
    for row, m in zip(table, metrics, strict=True):
        assert float(row["train_loss"]) == m["loss"]
        assert float(row["train_accuracy"]) == m["mean_token_accuracy"]
        assert float(row["learning_rate"]) == m["learning_rate"]
        assert (row["valid_loss"] == "") == ("valid_loss" not in m)
        if "valid_loss" in m:
            assert float(row["valid_loss"]) == m["valid_loss"]
            assert float(row["valid_mean_token_accuracy"]) == m["valid_mean_token_accuracy"]
    assert [r["valid_loss"] != "" for r in table] == [False, True, False, True]


def test_trained_tokens_are_the_training_files_tokens_times_epochs(trained: Trained) -> None:
    """Counted independently: each row rendered with the model's chat template and tokenized whole."""
    from transformers import AutoTokenizer

    from service.config import get_settings

    tokenizer = AutoTokenizer.from_pretrained(get_settings().models_dir / "tiny-llama")
    per_epoch = 0
    for row in TRAIN_ROWS:
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        per_epoch += len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert trained.job["trained_tokens"] == per_epoch * N_EPOCHS


def test_estimated_finish_is_set_and_kept_current_while_running(stack_client: httpx.Client) -> None:
    hp = {"n_epochs": 100, "batch_size": 2}  # 800 steps: far longer than the test watches it
    job_id = stack_client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": MODEL,
            "training_file": upload_ok(stack_client, chat_rows(16)),
            "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
        },
    ).json()["id"]
    seen: list[tuple[float, dict[str, Any]]] = []
    deadline = time.monotonic() + 180
    while len(seen) < 2:
        assert time.monotonic() < deadline, seen
        polled_at = time.time()
        job = stack_client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
        running = job["status"] == "running" and job["current_step"] >= 3 and job["estimated_finish"]
        if running and (not seen or job["current_step"] > seen[-1][1]["current_step"] + 3):
            seen.append((polled_at, job))
        time.sleep(0.3)
    for polled_at, job in seen:
        # in the future, and no later than extrapolating from `started_at` (which also counts the
        # model loading the estimate leaves out), with one second of rounding
        left = job["total_steps"] - job["current_step"]
        upper = polled_at + left * (polled_at - job["started_at"] + 1) / job["current_step"]
        assert polled_at - 2 <= job["estimated_finish"] <= upper + 2, (polled_at, job)
    cancelled = stack_client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").json()
    assert cancelled["status"] == "cancelled" and cancelled["estimated_finish"] is None


def _final_blob(job_id: str) -> tuple[str, Path | None]:
    from sqlalchemy import select

    from service.config import get_settings
    from service.db import session_scope
    from service.models import Checkpoint

    with session_scope() as session:
        key = session.scalar(
            select(Checkpoint.blob_key).where(Checkpoint.job_id == job_id, Checkpoint.is_final)
        )
    assert key is not None
    return key, (get_settings().data_dir / "blobs" / key) if key else None


def test_delete_model(trained: Trained, api_url: str) -> None:
    """Deleting keeps the job's history, hides the model everywhere models are resolved, and removes its
    blobs once the last unfinished job that fine-tunes from it ends. Runs last in this module."""
    job, name = trained.job, trained.job["fine_tuned_model"]
    assert name in [m.id for m in trained.oai.models.list()]
    checkpoints = all_pages(trained.http, f"/v1/fine_tuning/jobs/{job['id']}/checkpoints")
    final = next(c for c in checkpoints if c["is_final"])
    middle = next(c for c in checkpoints if not c["is_final"])

    # a job of the same tenant that fine-tunes from the model, created on the API whose broker no worker
    # reads (tests/conftest.py): it stays queued, so it still needs the model's blobs
    idle = httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {trained.key}"}, timeout=60)
    child = idle.post(
        "/v1/fine_tuning/jobs", json={"model": name, "training_file": upload_ok(idle, chat_rows(8))}
    )
    assert child.status_code == 200, child.text

    # another tenant cannot see or delete it; a base model cannot be deleted
    other = openai.OpenAI(base_url=trained.oai.base_url, api_key=new_key(), max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.models.delete(name)
    with pytest.raises(openai.PermissionDeniedError):
        trained.oai.models.delete(MODEL)

    deleted = trained.oai.models.delete(name)
    assert (deleted.id, deleted.object, deleted.deleted) == (name, "model", True)
    raw = trained.http.delete(f"/v1/models/{name}")
    assert raw.status_code == 404 and raw.json()["error"]["code"] == "model_not_found"

    # gone from the listing, retrieval, new jobs and the worker's model resolution
    assert name not in [m.id for m in trained.oai.models.list()]
    with pytest.raises(openai.NotFoundError):
        trained.oai.models.retrieve(name)
    again = trained.http.post(
        "/v1/fine_tuning/jobs", json={"model": name, "training_file": upload_ok(trained.http, chat_rows(8))}
    )
    assert again.status_code == 404, again.text
    assert again.json()["error"]["param"] == "model" and "deleted" in again.json()["error"]["message"]
    from service.config import get_settings
    from service.storage import get_blob_store
    from tests.helpers import tenant_of
    from worker.models import ModelNotAvailable, resolve_model_path

    with pytest.raises(ModelNotAvailable):
        resolve_model_path(get_settings(), get_blob_store(), tenant_id=tenant_of(trained.key), name=name)

    # the job keeps its history; the deleted model's download is gone, the other checkpoint's is not
    after = trained.http.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
    for field in ("status", "fine_tuned_model", "trained_tokens", "result_files", "finished_at"):
        assert after[field] == job[field], field
    assert len(all_pages(trained.http, f"/v1/fine_tuning/jobs/{job['id']}/checkpoints")) == len(checkpoints)
    gone = trained.http.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints/{final['id']}/content")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_deleted"
    kept = trained.http.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints/{middle['id']}/content")
    assert kept.status_code == 200

    # the queued child still needs the blobs; once it ends, the reconciler's sweep removes them
    key, path = _final_blob(job["id"])
    assert key and path is not None and path.exists()
    assert idle.post(f"/v1/fine_tuning/jobs/{child.json()['id']}/cancel").status_code == 200
    deadline = time.monotonic() + 60
    while _final_blob(job["id"])[0]:
        assert time.monotonic() < deadline, "the deleted model's blobs were never swept"
        time.sleep(0.5)
    assert not path.exists()
    idle.close()
    other.close()
