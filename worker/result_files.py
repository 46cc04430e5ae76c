"""The files a succeeded job gets, OpenAI's `result_files`: each one a File of the tenant with
`purpose: "fine-tune-results"`, downloadable with GET /v1/files/{id}/content.

`PRODUCERS` is the one list of them, in the order they appear on the job; a producer writes its file
under a scratch folder and describes it, or returns None when the job has nothing of its kind. To give
jobs another result file, append a producer here (as the `tensorboard` integration's event files).

The blobs are stored before the job's final status is written; the File rows are added in the same
transaction as `succeeded` (worker/job_process.py), so a job never lists a file that does not exist.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select

from service.db import session_scope
from service.files.service import RESULTS_PURPOSE, new_blob_key
from service.ids import new_id
from service.jobs.results import metrics_csv
from service.models import JobMetric
from service.storage import BlobStore
from worker.trackers import tensorboard_archive


@dataclass(frozen=True)
class ResultContext:
    job_id: str
    tenant_id: str
    method_type: str
    output_dir: Path  # the trainer's output folder, for producers that collect what the trainer wrote


@dataclass(frozen=True)
class ResultFile:
    filename: str
    path: Path
    format: str  # the File's `format`, which also sets the download's media type (service/files)
    line_count: int  # data rows (a CSV's header not counted)


Producer = Callable[[ResultContext, Path], ResultFile | None]


def step_metrics(ctx: ResultContext, scratch: Path) -> ResultFile | None:
    """Every logged step as OpenAI's results CSV (service/jobs/results.py)."""
    with session_scope() as session:
        rows = [
            (row.step, row.epoch, dict(row.values))
            for row in session.scalars(
                select(JobMetric).where(JobMetric.job_id == ctx.job_id).order_by(JobMetric.step)
            )
        ]
    if not rows:
        return None
    path = scratch / "step_metrics.csv"
    path.write_text(metrics_csv(rows), encoding="utf-8")
    return ResultFile("step_metrics.csv", path, "csv", len(rows))


def tensorboard_events(ctx: ResultContext, scratch: Path) -> ResultFile | None:
    """The job's metric rows as TensorBoard event files, a tar.gz, when its spec has a `tensorboard`
    integration (worker/trackers.py)."""
    path = tensorboard_archive(ctx.job_id, scratch)
    return None if path is None else ResultFile("tensorboard.tar.gz", path, "tar.gz", 0)


PRODUCERS: list[Producer] = [step_metrics, tensorboard_events]


def store_result_files(ctx: ResultContext, blobs: BlobStore, scratch: Path) -> list[dict[str, Any]]:
    """Run every producer and store its file as a blob; returns the File rows' values, in order."""
    scratch.mkdir(parents=True, exist_ok=True)
    rows = []
    for produce in PRODUCERS:
        result = produce(ctx, scratch)
        if result is None:
            continue
        file_id = new_id("file")
        key = new_blob_key(ctx.tenant_id, file_id, result.format)
        digest = hashlib.sha256()
        with result.path.open("rb") as fh:
            while chunk := fh.read(1024 * 1024):
                digest.update(chunk)
        size = blobs.put_file(key, result.path)
        rows.append(
            {
                "id": file_id,
                "tenant_id": ctx.tenant_id,
                "filename": result.filename,
                "purpose": RESULTS_PURPOSE,
                "bytes": size,
                "sha256": digest.hexdigest(),
                "line_count": result.line_count,
                "format": result.format,
                "blob_key": key,
            }
        )
    return rows
