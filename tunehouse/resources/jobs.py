"""`client.fine_tuning.jobs`: create and control jobs, read their events, metrics and checkpoints,
follow them live (`stream`) or block until they end (`wait`).

Each method is written once, for both clients (see `tunehouse._resource`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunehouse._base_client import (
    IDEMPOTENCY_HEADER,
    APIRequest,
    AsyncTransport,
    SyncTransport,
    compact,
    new_idempotency_key,
    raw,
)
from tunehouse._download import Download, Progress
from tunehouse._exceptions import TunehouseError
from tunehouse._pagination import PageRequest
from tunehouse._resource import AsyncAPIResource, SyncAPIResource, endpoint, paged, parse_as, streamed
from tunehouse._streaming import EventStream
from tunehouse.types import Checkpoint, FineTuningJob, JobEstimate, JobEvent, MetricRow, StreamItem

JOBS = "/v1/fine_tuning/jobs"


class WaitTimeout(TunehouseError):
    """`jobs.wait` gave up before the job ended (the job keeps running)."""


def _list_params(*, metadata: dict[str, str] | None = None, **fields: Any) -> dict[str, Any]:
    # OpenAI's list filter: ?metadata[key]=value
    params = compact(**fields)
    for key, value in (metadata or {}).items():
        params[f"metadata[{key}]"] = value
    return params


def _job(method: str, path: str, timeout: float | None, **fields: Any) -> APIRequest[FineTuningJob]:
    return APIRequest(method, path, parse_as(FineTuningJob), timeout=timeout, **fields)


@dataclass(frozen=True)
class _Wait:
    """Follow the stream to its end, then fetch the finished job."""

    job_id: str
    timeout: float | None
    on_item: Callable[[StreamItem], None] | None

    def _see(self, item: StreamItem, deadline: float | None) -> None:
        if self.on_item:
            self.on_item(item)
        if deadline and time.monotonic() > deadline:
            raise WaitTimeout(f"job {self.job_id} did not finish within {self.timeout} s")

    def _deadline(self) -> float | None:
        return time.monotonic() + self.timeout if self.timeout else None

    def run_sync(self, transport: SyncTransport) -> FineTuningJob:
        deadline = self._deadline()
        for item in EventStream(f"{JOBS}/{self.job_id}/stream").run_sync(transport):
            self._see(item, deadline)
        return _job("GET", f"{JOBS}/{self.job_id}", None).run_sync(transport)

    async def run_async(self, transport: AsyncTransport) -> FineTuningJob:
        deadline = self._deadline()
        async for item in EventStream(f"{JOBS}/{self.job_id}/stream").run_async(transport):
            self._see(item, deadline)
        return await _job("GET", f"{JOBS}/{self.job_id}", None).run_async(transport)


class _Checkpoints:
    @paged
    def list(
        self, job_id: str, *, after: str | None = None, limit: int | None = None, timeout: float | None = None
    ) -> PageRequest[Checkpoint]:
        params = _list_params(after=after, limit=limit)
        return PageRequest(
            raw("GET", f"{JOBS}/{job_id}/checkpoints", params=params, timeout=timeout), Checkpoint
        )

    @endpoint
    def download(
        self,
        job_id: str,
        checkpoint_id: str,
        path: str | Path,
        *,
        progress: Progress | None = None,
        timeout: float | None = None,
    ) -> Download:
        """Stream a checkpoint (a tar of the Hugging Face model folder) to `path`; `progress(done, total)`."""
        url = f"{JOBS}/{job_id}/checkpoints/{checkpoint_id}/content"
        return Download(url, Path(path), progress, timeout)


class _Jobs:
    @endpoint
    def create(
        self,
        *,
        model: str,
        training_file: str,
        method: dict[str, Any] | None = None,
        hyperparameters: dict[str, Any] | None = None,
        validation_file: str | None = None,
        suffix: str | None = None,
        seed: int | None = None,
        metadata: dict[str, str] | None = None,
        integrations: list[dict[str, Any]] | None = None,
        resources: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> APIRequest[FineTuningJob]:
        """Create a job. It is sent with an `Idempotency-Key` (`idempotency_key`, or a new one per call)
        and retried like a GET: the server answers a repeated key with the job the first try created."""
        body = compact(
            model=model,
            training_file=training_file,
            method=method,
            hyperparameters=hyperparameters,
            validation_file=validation_file,
            suffix=suffix,
            seed=seed,
            metadata=metadata,
            integrations=integrations,
            resources=resources,
        )
        key = idempotency_key or new_idempotency_key()
        return _job("POST", JOBS, timeout, json=body, headers={IDEMPOTENCY_HEADER: key}, deduplicated=True)

    @endpoint
    def estimate(
        self,
        *,
        model: str,
        training_file: str,
        method: dict[str, Any] | None = None,
        hyperparameters: dict[str, Any] | None = None,
        validation_file: str | None = None,
        suffix: str | None = None,
        seed: int | None = None,
        metadata: dict[str, str] | None = None,
        integrations: list[dict[str, Any]] | None = None,
        resources: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> APIRequest[JobEstimate]:
        """The pre-flight estimate of the job `create` would make with the same arguments (the same
        checks, a 400 naming the field); nothing is created or queued. Safe to retry."""
        body = compact(
            model=model,
            training_file=training_file,
            method=method,
            hyperparameters=hyperparameters,
            validation_file=validation_file,
            suffix=suffix,
            seed=seed,
            metadata=metadata,
            integrations=integrations,
            resources=resources,
        )
        return APIRequest(
            "POST", f"{JOBS}/estimate", parse_as(JobEstimate), json=body, timeout=timeout, deduplicated=True
        )

    @endpoint
    def retrieve(self, job_id: str, *, timeout: float | None = None) -> APIRequest[FineTuningJob]:
        return _job("GET", f"{JOBS}/{job_id}", timeout)

    @paged
    def list(
        self,
        *,
        after: str | None = None,
        limit: int | None = None,
        metadata: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> PageRequest[FineTuningJob]:
        params = _list_params(after=after, limit=limit, metadata=metadata)
        return PageRequest(raw("GET", JOBS, params=params, timeout=timeout), FineTuningJob)

    @endpoint
    def cancel(self, job_id: str, *, timeout: float | None = None) -> APIRequest[FineTuningJob]:
        return _job("POST", f"{JOBS}/{job_id}/cancel", timeout)

    @endpoint
    def pause(self, job_id: str, *, timeout: float | None = None) -> APIRequest[FineTuningJob]:
        """Checkpoint the job and release its GPUs; `resume` continues from that checkpoint."""
        return _job("POST", f"{JOBS}/{job_id}/pause", timeout)

    @endpoint
    def resume(self, job_id: str, *, timeout: float | None = None) -> APIRequest[FineTuningJob]:
        return _job("POST", f"{JOBS}/{job_id}/resume", timeout)

    @paged
    def list_events(
        self, job_id: str, *, after: str | None = None, limit: int | None = None, timeout: float | None = None
    ) -> PageRequest[JobEvent]:
        params = _list_params(after=after, limit=limit)
        return PageRequest(raw("GET", f"{JOBS}/{job_id}/events", params=params, timeout=timeout), JobEvent)

    @paged
    def metrics(
        self, job_id: str, *, after: int | None = None, limit: int | None = None, timeout: float | None = None
    ) -> PageRequest[MetricRow]:
        """Per-step metric rows (a tunehouse extension), paged by step."""
        params = _list_params(after=after, limit=limit)
        return PageRequest(raw("GET", f"{JOBS}/{job_id}/metrics", params=params, timeout=timeout), MetricRow)

    @streamed
    def stream(
        self, job_id: str, *, last_event_id: str | None = None, timeout: float | None = None
    ) -> EventStream:
        """Events and metric rows as they happen (history first), ending with a `StreamEnd`.

        A dropped connection, or a stream the server ended early (it drains on SIGTERM), is resumed where
        it stopped (`Last-Event-ID`), so no item is lost or repeated. `timeout`: seconds without a byte
        before reconnecting (default 60; the server sends a keep-alive every 15 s)."""
        return EventStream(f"{JOBS}/{job_id}/stream", last_event_id, timeout)

    @endpoint
    def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        on_item: Callable[[StreamItem], None] | None = None,
    ) -> _Wait:
        """Block until the job ends and return it; `on_item` sees every streamed event and metric row.
        Raises `WaitTimeout` after `timeout` seconds (the job keeps running)."""
        return _Wait(job_id, timeout, on_item)


class Checkpoints(_Checkpoints, SyncAPIResource):
    pass


class AsyncCheckpoints(_Checkpoints, AsyncAPIResource):
    pass


class Jobs(_Jobs, SyncAPIResource):
    def __init__(self, transport: SyncTransport) -> None:
        super().__init__(transport)
        self.checkpoints = Checkpoints(transport)


class AsyncJobs(_Jobs, AsyncAPIResource):
    def __init__(self, transport: AsyncTransport) -> None:
        super().__init__(transport)
        self.checkpoints = AsyncCheckpoints(transport)
