"""One job in one process of its own: `python -m worker.job_process JOB_ID WORKER_ID`, or a spare trainer
started ahead of its job, `python -m worker.job_process --spare`, given "JOB_ID WORKER_ID" on stdin
(worker/spare_trainer.py).

Loads the job and its files, resolves the base model, resumes from the job's latest checkpoint if
there is one, runs the trainer with a JobReporter, and records the outcome while holding the lease.
Exits 0 whenever the outcome is recorded (succeeded, failed with a reason, cancelled, paused, handed
back); any other exit is a crash the supervisor turns into a restart (worker/recovery.py).

A multi-GPU job runs this module once per rank (worker/launch.py). Every rank loads the same inputs
and trains its share of each step; rank 0 alone reports and records the outcome. A failed collective
(another rank died or hung) exits non-zero without recording anything: the supervisor requeues the job
and it resumes from its latest checkpoint. An error in the user's data or spec is the same on every
rank: rank 0 records it, the other ranks exit quietly.

SIGTERM (the worker shutting down, or the worker's death through PR_SET_PDEATHSIG) makes the trainer
write a resumable checkpoint at its next step and hand the job back to the queue; if that takes longer
than settings.shutdown_grace_seconds the process ends itself (SIGALRM) and the job resumes from its
previous checkpoint.
"""

from __future__ import annotations

from worker.launch import leave_out_bitsandbytes_if_asked

leave_out_bitsandbytes_if_asked()  # before the imports below import peft

import logging
import math
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import setproctitle
from sqlalchemy import select

from service.config import get_settings
from service.db import session_scope
from service.jobs import lifecycle, repository
from service.jobs.events import add_event, state_event
from service.jobs.live import live_publisher
from service.jobs.resources import job_resources
from service.jobs.spec import MethodBase, load_method
from service.models import File, Job
from service.storage import BlobStore, BlobStoreUnavailable, get_blob_store
from trainers.core import distributed
from trainers.core.distributed import CollectiveError
from trainers.core.errors import DataError
from trainers.core.loop import NullCallbacks, StopRequest
from trainers.data.jsonl_rows import JsonlRows
from trainers.families.shared_base import SharedBase
from trainers.registry import METHODS, resolve
from worker import reference_log_probs, shared_base_host
from worker.checkpoints import restore_latest_checkpoint
from worker.file_images import fetched_images
from worker.graders import reward_set
from worker.launch import HOST_FLAG, TRAINER_MODULE, die_with_parent, trainer_command
from worker.methods import RunInputs, keeps_reference_log_probs, run_method
from worker.models import ModelNotAvailable, resolve_model_path
from worker.outage import blob_outage_event, retry_blob, retry_db
from worker.recovery import hand_back
from worker.reporter import JobReporter
from worker.result_files import ResultContext, store_result_files
from worker.spare_trainer import SPARE_FLAG
from worker.trackers import Tracker, TrackerUnavailable, open_trackers

log = logging.getLogger("tunehouse.worker")


class JobSpecError(Exception):
    """The job cannot run because of its spec or inputs (the user's side)."""

    def __init__(self, message: str, *, param: str | None, code: str) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def read_rows(blobs: BlobStore, file_row: File | None, *, param: str, workdir: Path) -> JsonlRows:
    """The file's rows, read from a local copy one at a time: the blob is streamed to ``workdir``, never
    held in memory, and each row is parsed only when the trainer's tokenizer reaches it."""
    if file_row is None:
        raise JobSpecError(f"{param} was deleted before the job ran", param=param, code="file_not_found")
    local = workdir / f"{param}.jsonl"
    with local.open("wb") as fh:
        blobs.copy_to(file_row.blob_key, fh)
    return JsonlRows(local, param=param)


def _fail(job_id: str, worker_id: str, *, code: str, message: str, param: str | None, fault: str) -> None:
    with session_scope() as session:
        error = {"code": code, "message": message, "param": param, "fault": fault}
        if lifecycle.finish(session, job_id=job_id, worker_id=worker_id, status="failed", error=error):
            add_event(
                session,
                job_id,
                f"Job failed: {message}",
                level="error",
                data=state_event("failed", code=code, fault=fault),
            )


def _stop_on_sigterm(grace_seconds: float) -> threading.Event:
    stop = threading.Event()

    def handle(_signum: int, _frame: object) -> None:
        if not stop.is_set():
            stop.set()
            # a backstop for when no supervisor is left to enforce the grace period
            signal.alarm(max(1, math.ceil(grace_seconds)))

    signal.signal(signal.SIGTERM, handle)
    return stop


def load_inputs(
    job: Job, method: MethodBase, *, blobs: BlobStore, workdir: Path, announce: bool
) -> RunInputs:
    """Everything the run reads from the blob store (retried as a whole while it is down)."""
    settings = get_settings()
    with session_scope() as session:
        training = session.get(File, job.training_file)
        validation = session.get(File, job.validation_file) if job.validation_file else None
        session.expunge_all()
    model_path = resolve_model_path(
        settings, blobs, tenant_id=job.tenant_id, name=job.model, include_deleted=True
    )
    train_rows = read_rows(blobs, training, param="training_file", workdir=workdir)
    valid_rows = None
    if job.validation_file:
        valid_rows = read_rows(blobs, validation, param="validation_file", workdir=workdir)
    with_images = [f.blob_key for f in (training, validation) if f is not None and f.images]
    images_dir = fetched_images(blobs, with_images, workdir=workdir)
    reference_cache = None
    if training is not None and keeps_reference_log_probs(method):
        reference_cache = workdir / "reference-logps.npz"
        reference_log_probs.fetch(blobs, tenant_id=job.tenant_id, file_id=training.id, dest=reference_cache)
    resume_from, resume_step = restore_latest_checkpoint(blobs, job.id, workdir)
    if resume_from is not None and announce:
        with session_scope() as session:
            add_event(session, job.id, f"Resuming from the checkpoint at step {resume_step}")
    rewards = reward_set(method, settings=settings, blobs=blobs, tenant_id=job.tenant_id)
    return RunInputs(
        model_path=model_path,
        output_dir=workdir / "out",
        seed=job.seed,
        resume_from=resume_from,
        train_rows=train_rows,
        valid_rows=valid_rows,
        rewards=rewards,
        save_minutes=settings.checkpoint_minutes,
        keep_checkpoints=settings.checkpoint_keep,
        reference_cache_file=reference_cache,
        images_dir=images_dir,
    )


def _load_retrying(
    job: Job, method: MethodBase, *, blobs: BlobStore, workdir: Path, announce: bool
) -> RunInputs:
    settings = get_settings()
    return retry_blob(
        lambda: load_inputs(job, method, blobs=blobs, workdir=workdir, announce=announce),
        what=f"job {job.id}: loading inputs",
        tolerance=settings.blob_outage_tolerance_seconds,
        on_first_retry=(
            (lambda exc: blob_outage_event(job.id, exc, settings.blob_outage_tolerance_seconds))
            if announce
            else None
        ),
    )


def run(job_id: str, worker_id: str, *, shutdown: threading.Event | None = None) -> None:
    """Run the job as this process's rank. `shutdown`: set by whoever stops the run early (a Ray rank
    passes its own, worker/ray_rank.py); by default SIGTERM sets it."""
    settings = get_settings()
    shutdown = shutdown or _stop_on_sigterm(settings.shutdown_grace_seconds)
    with session_scope() as session:
        job = repository.job(session, job_id)
        assert job is not None
        session.expunge_all()
    method = load_method(job.method)
    # under Ray Train the group is Ray's: it was joined before and Ray tears it down
    joined = distributed.init_from_env(
        timeout_seconds=settings.collective_timeout_seconds, strategy=job_resources(job.resources).strategy
    )
    try:
        if distributed.is_main():
            _run_main(job, method, worker_id=worker_id, shutdown=shutdown)
        else:
            _run_other_rank(job, method)
    finally:
        if joined:
            distributed.shutdown()


def _make_workdir(prefix: str) -> Path:
    """The job's scratch folder in the data dir, also where the trainer's tokenized examples spill
    (``trainers.data.example_store`` writes to ``tempfile``'s directory): the data disk, not a small /tmp.
    A process that trains several jobs (a shared base) points ``tempfile`` at the data dir once instead."""
    data_dir = get_settings().data_dir
    data_dir.mkdir(parents=True, exist_ok=True)  # a Ray node may not have run a job before
    workdir = Path(tempfile.mkdtemp(dir=data_dir, prefix=prefix))
    if threading.current_thread() is threading.main_thread():
        tempfile.tempdir = str(workdir)
    return workdir


def run_on_shared_base(job_id: str, worker_id: str, base: SharedBase, shutdown: threading.Event) -> None:
    """Run the job in this thread, as one of the jobs on the process's shared base model
    (worker/shared_base_host.py): its LoRA adapter on ``base``, everything else as in ``run``. One rank."""
    with session_scope() as session:
        job = repository.job(session, job_id)
        assert job is not None
        session.expunge_all()
    _run_main(job, load_method(job.method), worker_id=worker_id, shutdown=shutdown, seat=base.seat(job_id))


def _run_other_rank(job: Job, method: MethodBase) -> None:
    """A rank > 0: train its share; rank 0 reports, checkpoints and records the outcome."""
    # rank 0 prepares the shared inputs first (the demo model is built once, by rank 0: transformers
    # writes weights from the main rank only); if it fails instead, this barrier fails and we exit
    distributed.barrier()
    workdir = _make_workdir(f"work-{job.id}-r{distributed.rank()}-")
    try:
        inputs = _load_retrying(job, method, blobs=get_blob_store(), workdir=workdir, announce=False)
        run_method(method, inputs, NullCallbacks())
    except (DataError, ModelNotAvailable, JobSpecError):
        pass  # the same on rank 0, which records it
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_main(
    job: Job,
    method: MethodBase,
    *,
    worker_id: str,
    shutdown: threading.Event,
    seat: AbstractContextManager[None] | None = None,
) -> None:
    """Rank 0's run: inputs, training, checkpoints and the outcome. ``seat``: a job on a shared base trains
    in it (``SharedBase.seat``); its inputs' download and its results' upload run outside, beside the
    other jobs' steps."""
    settings = get_settings()
    job_id = job.id
    blobs = get_blob_store()
    # like OpenAI, a model fine-tuned from a fine-tuned model is named after the original base
    base = job.model.split(":")[1] if job.model.startswith("ft:") else job.model
    fine_tuned_model = f"ft:{base}:{job.tenant_id}:{job.suffix or ''}:{job.id}"
    workdir = _make_workdir(f"work-{job_id}-")
    trackers: list[Tracker] = []
    exit_code = 1  # what the trackers' runs end with: 0 once the job succeeded or paused
    try:
        inputs = _load_retrying(job, method, blobs=blobs, workdir=workdir, announce=True)
        log_probs = None  # the training file's kept reference log-probs, for DPO
        if inputs.reference_cache_file is not None:
            log_probs = reference_log_probs.KeptLogProbs(
                blobs,
                tenant_id=job.tenant_id,
                file_id=job.training_file,
                path=inputs.reference_cache_file,
                stored=reference_log_probs.stamp(inputs.reference_cache_file),
            )
        distributed.barrier()  # the other ranks load theirs now (`_run_other_rank`)
        trackers = open_trackers(job, method)
        publisher = live_publisher(settings.redis_url) if settings.redis_url else None
        reporter = JobReporter(
            job_id=job_id,
            tenant_id=job.tenant_id,
            worker_id=worker_id,
            fine_tuned_model=fine_tuned_model,
            settings=settings,
            blobs=blobs,
            publisher=publisher,
            shutdown=shutdown,
            trackers=trackers,
            at_train_begin=log_probs.store_if_changed if log_probs is not None else None,
        )
        try:
            with seat or nullcontext():
                result = run_method(method, inputs, reporter)
        finally:  # no row is written behind the outcome recorded below
            reporter.close()
        reporter.flush(wait=True)
        if log_probs is not None:  # retries a failed upload at train begin; also when paused or stopped
            log_probs.store_if_changed()
        if result.stopped == StopRequest.PAUSE:
            exit_code = 0
            why = (
                f"worker {worker_id} is shutting down" if shutdown.is_set() else "pause requested"
            ) + f"; checkpoint saved at step {result.steps}"
            with session_scope() as session:
                hand_back(session, job_id=job_id, worker_id=worker_id, why=why)
            return
        if result.stopped is not None:
            with session_scope() as session:
                add_event(
                    session, job_id, f"Training stopped at step {result.steps} ({result.stopped.value})"
                )
            return
        tokens = reporter.last_row.get("trained_tokens")
        context = ResultContext(
            job_id=job_id, tenant_id=job.tenant_id, method_type=method.type, output_dir=workdir / "out"
        )
        result_files = store_result_files(context, blobs, workdir / "results")
        recorded = False

        def record_success() -> None:
            nonlocal recorded
            recorded = False
            with session_scope() as session:
                if lifecycle.finish(
                    session,
                    job_id=job_id,
                    worker_id=worker_id,
                    status="succeeded",
                    fine_tuned_model=fine_tuned_model,
                    trained_tokens=int(tokens) if tokens is not None else None,
                    result_files=[f["id"] for f in result_files],
                ):
                    recorded = True
                    session.add_all(File(**values) for values in result_files)
                    add_event(
                        session,
                        job_id,
                        "The job has successfully completed",
                        data=state_event("succeeded", fine_tuned_model=fine_tuned_model),
                    )

        # the model is trained and saved: a database outage now must not turn it into a failure
        retry_db(
            record_success, what=f"job {job_id}: final status", tolerance=settings.db_outage_tolerance_seconds
        )
        if not recorded:
            # cancelled at the last moment (or an earlier attempt's commit landed after all): blobs
            # that no File row points at are dropped
            with session_scope() as session:
                kept = set(
                    session.scalars(select(File.id).where(File.id.in_([f["id"] for f in result_files])))
                )
            for values in result_files:
                if values["id"] not in kept:
                    blobs.delete(values["blob_key"])
        exit_code = 0
    except CollectiveError:
        # another rank died or hung: no outcome to record; the supervisor requeues the job
        raise
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
    except BlobStoreUnavailable as exc:
        _fail(job_id, worker_id, code=exc.code or "", message=exc.message, param=None, fault="system")
    except TrackerUnavailable as exc:  # the deployment lacks what the job asked for
        _fail(
            job_id,
            worker_id,
            code="integration_unavailable",
            message=exc.message,
            param=exc.param,
            fault="system",
        )
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
        for tracker in trackers:
            tracker.finish(exit_code=exit_code)
        shutil.rmtree(workdir, ignore_errors=True)


def wait_as_spare() -> None:
    """A spare trainer (worker/spare_trainer.py): with this module imported, import the methods'
    trainers too, then wait for "JOB_ID WORKER_ID" on stdin and run that job, or for
    "--shared-base WORKER_ID NOTICES" and be a shared-base trainer; end without either."""
    for method in METHODS.values():
        resolve(method.trainer), resolve(method.config)
    line = sys.stdin.readline().split()
    if len(line) == 3 and line[0] == HOST_FLAG:
        serve_shared_base(line[1], line[2])
        return
    if len(line) != 2:
        return  # stdin closed: the worker stops
    job_id, worker_id = line
    # `ps` and the tests find a job's trainer by its command line, as if it had been started for it
    setproctitle.setproctitle(shlex.join(trainer_command(job_id, worker_id, ranks=1, grace_seconds=0)))
    run(job_id, worker_id)


def serve_shared_base(worker_id: str, notices: str) -> None:
    """Be the trainer of this worker's jobs on one shared base (worker/shared_base_host.py)."""
    title = [sys.executable, "-m", TRAINER_MODULE, HOST_FLAG, worker_id, notices]
    shared_base_host.serve(worker_id, notices, run_on_shared_base, title=title)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if distributed.launched_ranks() > 1:
        die_with_parent()  # a rank's parent is the launcher, not the supervisor
    if sys.argv[1] == SPARE_FLAG:
        wait_as_spare()
    elif sys.argv[1] == HOST_FLAG:
        serve_shared_base(sys.argv[2], sys.argv[3])
    else:
        run(sys.argv[1], sys.argv[2])
