"""Drop-in compatibility: the official `openai` package drives tunehouse, unchanged apart from
`base_url` and `api_key`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import Stack
from tests.e2e.test_preference_methods import preference_rows
from tests.helpers import chat_rows, jsonl

MODEL = "tunehouse/tiny-llama"


@pytest.fixture
def oai(stack: Stack, api_key: str) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=api_key, max_retries=0)
    yield client
    client.close()


def test_openai_client_end_to_end(oai: openai.OpenAI, tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(jsonl(chat_rows(16)))
    with path.open("rb") as fh:
        uploaded = oai.files.create(file=fh, purpose="fine-tune")
    assert (
        uploaded.id.startswith("file-")
        and uploaded.purpose == "fine-tune"
        and uploaded.bytes == path.stat().st_size
    )

    job = oai.fine_tuning.jobs.create(
        model=MODEL,
        training_file=uploaded.id,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 4}}},
        suffix="oai",
        seed=5,
    )
    assert job.object == "fine_tuning.job" and job.status in ("queued", "running")
    assert job.method is not None and job.method.type == "supervised"
    assert job.hyperparameters.n_epochs == 2 and job.seed == 5

    deadline = time.monotonic() + 240
    while (job := oai.fine_tuning.jobs.retrieve(job.id)).status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert job.status == "succeeded" and job.fine_tuned_model and job.fine_tuned_model.startswith("ft:")

    events = oai.fine_tuning.jobs.list_events(job.id, limit=5)
    assert len(events.data) == 5 and events.has_more
    all_events = list(oai.fine_tuning.jobs.list_events(job.id, limit=5))  # auto-pagination via `after`
    assert len(all_events) > 5 and all_events[0].message == "The job has successfully completed"
    assert len({e.id for e in all_events}) == len(all_events)

    checkpoints = oai.fine_tuning.jobs.checkpoints.list(job.id)
    assert checkpoints.data and checkpoints.data[0].object == "fine_tuning.job.checkpoint"
    assert any(c.fine_tuned_model_checkpoint == job.fine_tuned_model for c in checkpoints.data)
    assert checkpoints.data[0].metrics.step is not None

    # DPO through the same client
    pref_path = tmp_path / "pref.jsonl"
    pref_path.write_bytes(jsonl(preference_rows()))
    pref = oai.files.create(file=pref_path.read_bytes(), purpose="fine-tune")
    dpo = oai.fine_tuning.jobs.create(
        model=MODEL,
        training_file=pref.id,
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 1}}},
    )
    assert dpo.method is not None and dpo.method.type == "dpo"
    assert dpo.method.dpo is not None and dpo.method.dpo.hyperparameters is not None
    assert dpo.method.dpo.hyperparameters.beta == 0.2

    # list with pagination, newest first
    first = oai.fine_tuning.jobs.list(limit=1)
    assert [j.id for j in first.data] == [dpo.id] and first.has_more
    assert [j.id for j in oai.fine_tuning.jobs.list(limit=1)][:2] == [dpo.id, job.id]

    # pause and resume return the job object, as OpenAI's do (it has barely started: still queued,
    # or running while its trainer loads, when a pause is recorded and carried out at the first step)
    paused = oai.fine_tuning.jobs.pause(dpo.id)
    assert paused.object == "fine_tuning.job" and paused.status in ("paused", "running")
    assert oai.fine_tuning.jobs.resume(dpo.id).status in ("queued", "running")
    cancelled = oai.fine_tuning.jobs.cancel(dpo.id)
    assert cancelled.status == "cancelled"

    with pytest.raises(openai.NotFoundError):
        oai.fine_tuning.jobs.retrieve("ftjob-missing")
    with pytest.raises(openai.BadRequestError) as bad:
        oai.fine_tuning.jobs.create(model="gpt-4o-mini", training_file=uploaded.id)
    assert bad.value.body is not None and bad.value.body["param"] == "model"  # type: ignore[index]
