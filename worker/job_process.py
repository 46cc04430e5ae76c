"""One job in one fresh process: `python -m worker.job_process JOB_ID WORKER_ID`.

Loads the job and its files, resolves the base model, resumes from the job's latest checkpoint if
there is one, runs the trainer with a JobReporter, and records the outcome while holding the lease.
Exits 0 whenever the outcome is recorded (succeeded, failed with a reason, cancelled).
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tarfile
import tempfile
import traceback
from pathlib import Path
from typing import Any

from sqlalchemy import select

from service.config import get_settings
from service.db import session_scope
from service.jobs.events import add_event
from service.jobs.spec import load_method
from service.models import Checkpoint, File, Job
from service.storage import LocalBlobStore, get_blob_store
from trainers.errors import DataError
from worker import lease
from worker.graders import reward_functions
from worker.methods import RunInputs, run_method
from worker.models import ModelNotAvailable, resolve_model_path
from worker.reporter import JobReporter

log = logging.getLogger("tunehouse.worker")


class JobSpecError(Exception):
    """The job cannot run because of its spec or inputs (the user's side)."""

    def __init__(self, message: str, *, param: str | None, code: str) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def read_rows(blobs: LocalBlobStore, file_row: File | None, *, param: str) -> list[dict[str, Any]]:
    if file_row is None:
        raise JobSpecError(f"{param} was deleted before the job ran", param=param, code="file_not_found")
    rows = []
    with blobs.open(file_row.blob_key) as fh:
        for raw in fh:
            if raw.strip():
                rows.append(json.loads(raw))
    return rows


def restore_latest_checkpoint(blobs: LocalBlobStore, job_id: str, workdir: Path) -> tuple[Path | None, int]:
    with session_scope() as session:
        ckpt = session.scalars(
            select(Checkpoint)
            .where(Checkpoint.job_id == job_id, Checkpoint.state_blob_key.is_not(None))
            .order_by(Checkpoint.step.desc())
            .limit(1)
        ).first()
    if ckpt is None or ckpt.state_blob_key is None:
        return None, 0
    folder = workdir / "resume"
    for part, key in (("model", ckpt.blob_key), ("state", ckpt.state_blob_key)):
        (folder / part).mkdir(parents=True, exist_ok=True)
        with blobs.open(key) as fh, tarfile.open(fileobj=fh, mode="r|") as tar:
            tar.extractall(folder / part, filter="data")
    return folder, ckpt.step


def _fail(job_id: str, worker_id: str, *, code: str, message: str, param: str | None, fault: str) -> None:
    with session_scope() as session:
        error = {"code": code, "message": message, "param": param, "fault": fault}
        if lease.finish(session, job_id=job_id, worker_id=worker_id, status="failed", error=error):
            add_event(
                session, job_id, f"Job failed: {message}", level="error", data={"code": code, "fault": fault}
            )


def run(job_id: str, worker_id: str) -> None:
    settings = get_settings()
    blobs = get_blob_store()
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None
        training = session.get(File, job.training_file)
        validation = session.get(File, job.validation_file) if job.validation_file else None
        session.expunge_all()
    method = load_method(job.method)
    # like OpenAI, a model fine-tuned from a fine-tuned model is named after the original base
    base = job.model.split(":")[1] if job.model.startswith("ft:") else job.model
    fine_tuned_model = f"ft:{base}:{job.tenant_id}:{job.suffix or ''}:{job.id}"
    workdir = Path(tempfile.mkdtemp(dir=settings.data_dir, prefix=f"work-{job_id}-"))
    try:
        model_path = resolve_model_path(settings, blobs, tenant_id=job.tenant_id, name=job.model)
        train_rows = read_rows(blobs, training, param="training_file")
        valid_rows = read_rows(blobs, validation, param="validation_file") if job.validation_file else None
        resume_from, resume_step = restore_latest_checkpoint(blobs, job_id, workdir)
        if resume_from is not None:
            with session_scope() as session:
                add_event(session, job_id, f"Resuming from the checkpoint at step {resume_step}")
        reward_funcs, reward_names = reward_functions(
            method, settings=settings, blobs=blobs, tenant_id=job.tenant_id
        )
        inputs = RunInputs(
            model_path=model_path,
            output_dir=workdir / "out",
            seed=job.seed,
            resume_from=resume_from,
            train_rows=train_rows,
            valid_rows=valid_rows,
            reward_funcs=reward_funcs,
            reward_names=reward_names,
        )
        publisher = None
        if settings.redis_url:
            import redis

            publisher = redis.Redis.from_url(settings.redis_url)
        reporter = JobReporter(
            job_id=job_id,
            tenant_id=job.tenant_id,
            worker_id=worker_id,
            fine_tuned_model=fine_tuned_model,
            settings=settings,
            blobs=blobs,
            publisher=publisher,
        )
        result = run_method(method, inputs, reporter)
        reporter.flush()
        if result.stopped is not None:
            with session_scope() as session:
                add_event(
                    session, job_id, f"Training stopped at step {result.steps} ({result.stopped.value})"
                )
            return
        tokens = reporter.last_row.get("trained_tokens")
        with session_scope() as session:
            if lease.finish(
                session,
                job_id=job_id,
                worker_id=worker_id,
                status="succeeded",
                fine_tuned_model=fine_tuned_model,
                trained_tokens=int(tokens) if tokens is not None else None,
            ):
                add_event(
                    session,
                    job_id,
                    "The job has successfully completed",
                    data={"fine_tuned_model": fine_tuned_model},
                )
    except DataError as exc:
        _fail(
            job_id,
            worker_id,
            code="invalid_training_data",
            message=exc.message,
            param=exc.param or "training_file",
            fault="user",
        )
    except ModelNotAvailable as exc:
        _fail(
            job_id, worker_id, code="model_not_available", message=exc.message, param=exc.param, fault="user"
        )
    except JobSpecError as exc:
        _fail(job_id, worker_id, code=exc.code, message=exc.message, param=exc.param, fault="user")
    except Exception as exc:
        log.error("job %s failed:\n%s", job_id, traceback.format_exc())
        _fail(
            job_id,
            worker_id,
            code="internal_error",
            message=f"{type(exc).__name__}: {exc}",
            param=None,
            fault="system",
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(sys.argv[1], sys.argv[2])
