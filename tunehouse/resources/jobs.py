"""`client.fine_tuning.jobs`: create and control jobs, read their events, metrics and checkpoints,
follow them live (`stream`) or block until they end (`wait`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from tunehouse._base_client import AsyncTransport, SyncTransport, connection_error, retry_delay
from tunehouse._exceptions import APIConnectionError, TunehouseError, status_error
from tunehouse._pagination import AsyncPage, SyncPage
from tunehouse._streaming import SSEDecoder, to_item
from tunehouse.types import Checkpoint, FineTuningJob, JobEvent, MetricRow, StreamEnd, StreamItem

JOBS = "/v1/fine_tuning/jobs"
# a stream is a long GET: no read timeout beyond the server's keep-alives (sent every 15 s)
STREAM_TIMEOUT = httpx.Timeout(10.0, read=60.0)
# backoff 0.5, 1, 2, 4, 8, 8, 8, 8 s: about 40 s to ride out an API restart (the server drains on
# SIGTERM and a single instance takes seconds to come back)
STREAM_RECONNECTS = 8


class WaitTimeout(TunehouseError):
    """`jobs.wait` gave up before the job ended (the job keeps running)."""


def _create_body(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def _params(**fields: Any) -> dict[str, Any]:
    params = {k: v for k, v in fields.items() if v is not None and k != "metadata"}
    for key, value in (fields.get("metadata") or {}).items():
        params[f"metadata[{key}]"] = value
    return params


def _content_length(response: httpx.Response) -> int | None:
    raw = response.headers.get("content-length")
    return int(raw) if raw and raw.isdigit() else None


class _DownloadSink:
    """Where a streamed checkpoint goes: `<path>.part`, renamed to `path` only when complete."""

    def __init__(self, path: str | Path, progress: Callable[[int, int | None], None] | None) -> None:
        self.dest = Path(path)
        self.tmp = self.dest.with_name(self.dest.name + ".part")
        self.progress = progress
        self.done = 0
        self.total: int | None = None
        self.fh = self.tmp.open("wb")

    def start(self, response: httpx.Response) -> None:
        self.total = _content_length(response)

    def write(self, chunk: bytes) -> None:
        self.fh.write(chunk)
        self.done += len(chunk)
        if self.progress:
            self.progress(self.done, self.total)

    def finish(self) -> Path:
        self.fh.close()
        self.tmp.replace(self.dest)
        return self.dest

    def abort(self) -> None:
        self.fh.close()
        self.tmp.unlink(missing_ok=True)


def _decode(decoder: SSEDecoder, line: str) -> list[StreamItem]:
    """The typed items one SSE line completes (usually none, at a blank line one)."""
    return [item for sse in decoder.feed(line) if (item := to_item(sse)) is not None]


def _headers(last_event_id: str | None) -> dict[str, str]:
    return {"Accept": "text/event-stream", **({"Last-Event-ID": last_event_id} if last_event_id else {})}


class Checkpoints:
    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport

    def list(
        self, job_id: str, *, after: str | None = None, limit: int | None = None
    ) -> SyncPage[Checkpoint]:
        body = self._t.request(
            "GET", f"{JOBS}/{job_id}/checkpoints", params=_params(after=after, limit=limit)
        ).json()
        return SyncPage(
            [Checkpoint.model_validate(x) for x in body["data"]],
            body["has_more"],
            lambda cursor: self.list(job_id, after=cursor, limit=limit),
        )

    def download(
        self,
        job_id: str,
        checkpoint_id: str,
        path: str | Path,
        *,
        progress: Callable[[int, int | None], None] | None = None,
    ) -> Path:
        """Stream a checkpoint (a tar of the Hugging Face model folder) to `path`; `progress(done, total)`."""
        sink = _DownloadSink(path, progress)
        try:
            with self._t.http.stream(
                "GET", f"{JOBS}/{job_id}/checkpoints/{checkpoint_id}/content"
            ) as response:
                if not response.is_success:
                    response.read()
                    raise status_error(response)
                sink.start(response)
                for chunk in response.iter_bytes(1024 * 1024):
                    sink.write(chunk)
        except httpx.TransportError as exc:
            sink.abort()
            raise connection_error(exc) from exc
        except BaseException:
            sink.abort()
            raise
        return sink.finish()


class Jobs:
    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport
        self.checkpoints = Checkpoints(transport)

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
        timeout: float | None = None,
    ) -> FineTuningJob:
        body = _create_body(
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
        return FineTuningJob.model_validate(self._t.request("POST", JOBS, json=body, timeout=timeout).json())

    def retrieve(self, job_id: str, *, timeout: float | None = None) -> FineTuningJob:
        return FineTuningJob.model_validate(
            self._t.request("GET", f"{JOBS}/{job_id}", timeout=timeout).json()
        )

    def list(
        self, *, after: str | None = None, limit: int | None = None, metadata: dict[str, str] | None = None
    ) -> SyncPage[FineTuningJob]:
        body = self._t.request(
            "GET", JOBS, params=_params(after=after, limit=limit, metadata=metadata)
        ).json()
        return SyncPage(
            [FineTuningJob.model_validate(x) for x in body["data"]],
            body["has_more"],
            lambda cursor: self.list(after=cursor, limit=limit, metadata=metadata),
        )

    def cancel(self, job_id: str) -> FineTuningJob:
        return FineTuningJob.model_validate(self._t.request("POST", f"{JOBS}/{job_id}/cancel").json())

    def pause(self, job_id: str) -> FineTuningJob:
        return FineTuningJob.model_validate(self._t.request("POST", f"{JOBS}/{job_id}/pause").json())

    def resume(self, job_id: str) -> FineTuningJob:
        return FineTuningJob.model_validate(self._t.request("POST", f"{JOBS}/{job_id}/resume").json())

    def list_events(
        self, job_id: str, *, after: str | None = None, limit: int | None = None
    ) -> SyncPage[JobEvent]:
        body = self._t.request(
            "GET", f"{JOBS}/{job_id}/events", params=_params(after=after, limit=limit)
        ).json()
        return SyncPage(
            [JobEvent.model_validate(x) for x in body["data"]],
            body["has_more"],
            lambda cursor: self.list_events(job_id, after=cursor, limit=limit),
        )

    def metrics(
        self, job_id: str, *, after: int | None = None, limit: int | None = None
    ) -> SyncPage[MetricRow]:
        body = self._t.request(
            "GET", f"{JOBS}/{job_id}/metrics", params=_params(after=after, limit=limit)
        ).json()
        return SyncPage(
            [MetricRow.model_validate(x) for x in body["data"]],
            body["has_more"],
            lambda cursor: self.metrics(job_id, after=cursor, limit=limit),
        )

    def stream(self, job_id: str, *, last_event_id: str | None = None) -> Iterator[StreamItem]:
        """Events and metric rows as they happen (history first), ending with a `StreamEnd`.

        A dropped connection, or a stream the server ended early (it drains on SIGTERM), is resumed where
        it stopped (`Last-Event-ID`), so no item is lost or repeated.
        """
        reconnects = 0
        decoder = SSEDecoder()
        decoder.last_event_id = last_event_id
        while True:
            try:
                with self._t.http.stream(
                    "GET",
                    f"{JOBS}/{job_id}/stream",
                    headers=_headers(decoder.last_event_id),
                    timeout=STREAM_TIMEOUT,
                ) as response:
                    if not response.is_success:
                        response.read()
                        delay = retry_delay("GET", "", reconnects, STREAM_RECONNECTS, response)
                        if delay is None:
                            raise status_error(response)
                        time.sleep(delay)  # 503 during an outage or a restart: Retry-After, then again
                        reconnects += 1
                        continue
                    for line in response.iter_lines():
                        for item in _decode(decoder, line):
                            reconnects = 0
                            yield item
                            if isinstance(item, StreamEnd):
                                return
            except httpx.TransportError as exc:
                delay = retry_delay("GET", "", reconnects, STREAM_RECONNECTS, None)
                if delay is None:
                    raise connection_error(exc) from exc
                time.sleep(delay)
                reconnects += 1
                continue
            # ended before the job did: the server is draining (a restart, a deploy); come back
            delay = retry_delay("GET", "", reconnects, STREAM_RECONNECTS, None)
            if delay is None:
                raise APIConnectionError("the stream ended before the job did")
            time.sleep(delay)
            reconnects += 1

    def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        on_item: Callable[[StreamItem], None] | None = None,
    ) -> FineTuningJob:
        """Block until the job ends and return it; `on_item` sees every streamed event and metric row."""
        deadline = time.monotonic() + timeout if timeout else None
        for item in self.stream(job_id):
            if on_item:
                on_item(item)
            if deadline and time.monotonic() > deadline:
                raise WaitTimeout(f"job {job_id} did not finish within {timeout} s")
        return self.retrieve(job_id)


class AsyncCheckpoints:
    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport

    async def list(
        self, job_id: str, *, after: str | None = None, limit: int | None = None
    ) -> AsyncPage[Checkpoint]:
        response = await self._t.request(
            "GET", f"{JOBS}/{job_id}/checkpoints", params=_params(after=after, limit=limit)
        )
        body = response.json()
        return AsyncPage(
            [Checkpoint.model_validate(x) for x in body["data"]],
            body["has_more"],
            lambda cursor: self.list(job_id, after=cursor, limit=limit),
        )

    async def download(
        self,
        job_id: str,
        checkpoint_id: str,
        path: str | Path,
        *,
        progress: Callable[[int, int | None], None] | None = None,
    ) -> Path:
        """Stream a checkpoint (a tar of the Hugging Face model folder) to `path`; `progress(done, total)`."""
        sink = _DownloadSink(path, progress)
        try:
            url = f"{JOBS}/{job_id}/checkpoints/{checkpoint_id}/content"
            async with self._t.http.stream("GET", url) as response:
                if not response.is_success:
                    await response.aread()
                    raise status_error(response)
                sink.start(response)
                async for chunk in response.aiter_bytes(1024 * 1024):
                    sink.write(chunk)
        except httpx.TransportError as exc:
            sink.abort()
            raise connection_error(exc) from exc
        except BaseException:
            sink.abort()
            raise
        return sink.finish()


class AsyncJobs:
    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport
        self.checkpoints = AsyncCheckpoints(transport)

    async def create(self, *, model: str, training_file: str, **fields: Any) -> FineTuningJob:
        body = _create_body(model=model, training_file=training_file, **fields)
        return FineTuningJob.model_validate((await self._t.request("POST", JOBS, json=body)).json())

    async def retrieve(self, job_id: str) -> FineTuningJob:
        return FineTuningJob.model_validate((await self._t.request("GET", f"{JOBS}/{job_id}")).json())

    async def list(
        self, *, after: str | None = None, limit: int | None = None, metadata: dict[str, str] | None = None
    ) -> AsyncPage[FineTuningJob]:
        body = (
            await self._t.request("GET", JOBS, params=_params(after=after, limit=limit, metadata=metadata))
        ).json()
        return AsyncPage(
            [FineTuningJob.model_validate(x) for x in body["data"]],
            body["has_more"],
            lambda cursor: self.list(after=cursor, limit=limit, metadata=metadata),
        )

    async def cancel(self, job_id: str) -> FineTuningJob:
        return FineTuningJob.model_validate((await self._t.request("POST", f"{JOBS}/{job_id}/cancel")).json())

    async def pause(self, job_id: str) -> FineTuningJob:
        return FineTuningJob.model_validate((await self._t.request("POST", f"{JOBS}/{job_id}/pause")).json())

    async def resume(self, job_id: str) -> FineTuningJob:
        return FineTuningJob.model_validate((await self._t.request("POST", f"{JOBS}/{job_id}/resume")).json())

    async def list_events(
        self, job_id: str, *, after: str | None = None, limit: int | None = None
    ) -> AsyncPage[JobEvent]:
        response = await self._t.request(
            "GET", f"{JOBS}/{job_id}/events", params=_params(after=after, limit=limit)
        )
        body = response.json()
        return AsyncPage(
            [JobEvent.model_validate(x) for x in body["data"]],
            body["has_more"],
            lambda cursor: self.list_events(job_id, after=cursor, limit=limit),
        )

    async def metrics(
        self, job_id: str, *, after: int | None = None, limit: int | None = None
    ) -> AsyncPage[MetricRow]:
        response = await self._t.request(
            "GET", f"{JOBS}/{job_id}/metrics", params=_params(after=after, limit=limit)
        )
        body = response.json()
        return AsyncPage(
            [MetricRow.model_validate(x) for x in body["data"]],
            body["has_more"],
            lambda cursor: self.metrics(job_id, after=cursor, limit=limit),
        )

    async def stream(self, job_id: str, *, last_event_id: str | None = None) -> AsyncIterator[StreamItem]:
        decoder = SSEDecoder()
        decoder.last_event_id = last_event_id
        reconnects = 0
        while True:
            try:
                async with self._t.http.stream(
                    "GET",
                    f"{JOBS}/{job_id}/stream",
                    headers=_headers(decoder.last_event_id),
                    timeout=STREAM_TIMEOUT,
                ) as response:
                    if not response.is_success:
                        await response.aread()
                        delay = retry_delay("GET", "", reconnects, STREAM_RECONNECTS, response)
                        if delay is None:
                            raise status_error(response)
                        await asyncio.sleep(delay)  # 503 during an outage or a restart: Retry-After
                        reconnects += 1
                        continue
                    async for line in response.aiter_lines():
                        for item in _decode(decoder, line):
                            reconnects = 0
                            yield item
                            if isinstance(item, StreamEnd):
                                return
            except httpx.TransportError as exc:
                delay = retry_delay("GET", "", reconnects, STREAM_RECONNECTS, None)
                if delay is None:
                    raise connection_error(exc) from exc
                reconnects += 1
                await asyncio.sleep(delay)
                continue
            # ended before the job did: the server is draining (a restart, a deploy); come back
            delay = retry_delay("GET", "", reconnects, STREAM_RECONNECTS, None)
            if delay is None:
                raise APIConnectionError("the stream ended before the job did")
            reconnects += 1
            await asyncio.sleep(delay)

    async def wait(
        self, job_id: str, *, on_item: Callable[[StreamItem], None] | None = None
    ) -> FineTuningJob:
        async for item in self.stream(job_id):
            if on_item:
                on_item(item)
        return await self.retrieve(job_id)
