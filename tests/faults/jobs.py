"""What the fault tests do with jobs: submit tiny SFT jobs, follow their streams, check every job ran
once with every step recorded once."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

import tunehouse
from tests.helpers import all_pages

TINY = "tunehouse/tiny-llama"


def create_job(client: httpx.Client, training_file: str, **hyperparameters: Any) -> str:
    response = client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": TINY,
            "training_file": training_file,
            "seed": 0,
            "method": {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}},
        },
    )
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def wait_metrics(client: httpx.Client, job_id: str, at_least: int, timeout: float = 180) -> None:
    """Until the job has recorded step `at_least`'s metrics (it is really training). It asks for a row
    after step `at_least - 1` rather than counting rows: a page holds at most 1,000, and a fast host
    trains a long job past that before the check (CI once reached step 1,088)."""
    deadline = time.monotonic() + timeout
    url = f"/v1/fine_tuning/jobs/{job_id}/metrics"
    while not client.get(url, params={"after": at_least - 1, "limit": 1}).json()["data"]:
        assert time.monotonic() < deadline, f"job {job_id} recorded fewer than {at_least} steps"
        time.sleep(0.2)


def assert_ran_once(client: httpx.Client, job_id: str, status: str = "succeeded") -> dict[str, Any]:
    """Ended in `status`, started exactly once, and every step it trained recorded exactly once: all
    of 1..total_steps once it succeeded, 1..current_step for a job stopped early."""
    job: dict[str, Any] = client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["status"] == status, job
    events = [e["message"] for e in all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/events")]
    starts = [m for m in events if m.startswith("Job started on worker")]
    assert len(starts) == 1, starts
    steps = [m["step"] for m in all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/metrics")]
    assert steps == list(range(1, _steps_trained(job) + 1)), steps
    return job


def _steps_trained(job: dict[str, Any]) -> int:
    return int(job["total_steps"] if job["status"] == "succeeded" else job["current_step"])


@dataclass
class StreamReader:
    """Follows one job's stream through the SDK in a thread (reconnecting as the SDK does)."""

    base_url: str
    api_key: str
    job_id: str
    items: list[Any] = field(default_factory=list)
    error: BaseException | None = None
    first_item_at: float | None = None

    def __post_init__(self) -> None:
        self.opened_at = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with tunehouse.Client(base_url=self.base_url, api_key=self.api_key) as client:
                for item in client.fine_tuning.jobs.stream(self.job_id):
                    if self.first_item_at is None:
                        self.first_item_at = time.monotonic()
                    self.items.append(item)
        except BaseException as exc:  # reported by join()
            self.error = exc

    def join(self, timeout: float = 240) -> list[Any]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"stream of {self.job_id} did not end"
        if self.error is not None:
            raise self.error
        return self.items

    def assert_complete(self, client: httpx.Client) -> None:
        """Ended with `end`, and holds every event and metric row of the job exactly once, in order."""
        items = self.join()
        assert isinstance(items[-1], tunehouse.StreamEnd), items[-3:]
        job = client.get(f"/v1/fine_tuning/jobs/{self.job_id}").json()
        steps = [i.step for i in items if isinstance(i, tunehouse.MetricRow)]
        assert steps == list(range(1, _steps_trained(job) + 1)), steps
        streamed = [i.id for i in items if isinstance(i, tunehouse.JobEvent)]
        recorded = [e["id"] for e in all_pages(client, f"/v1/fine_tuning/jobs/{self.job_id}/events")]
        assert sorted(streamed) == sorted(recorded)
        assert len(streamed) == len(set(streamed))
