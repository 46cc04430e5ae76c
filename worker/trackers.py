"""A job's experiment trackers (its spec's `integrations`, service/jobs/integrations.py) on the worker.

- `wandb`: a Weights & Biases run per job, live: the job's config once, then every metric row the
  trainer reports (training steps and evaluations), at its step. The run id is the job id, so a job
  restarted after a crash or resumed after a pause continues the same run (`resume="allow"`). The
  worker's own W&B settings apply (WANDB_API_KEY, WANDB_MODE=offline, WANDB_DIR; without WANDB_DIR the
  run's files go under the data dir's `wandb/`, where `wandb sync` uploads offline runs later).
- `tensorboard`: the job's metrics as TensorBoard event files, tarred into a result file when the job
  succeeds (`tensorboard_result_file`). They are written from the job's stored metric rows, not live,
  so that the file is complete whatever restarts the job went through, on whichever hosts.

A tracker's package is optional (`pip install 'tunehouse[trackers]'`): a worker without it fails the
job before training with `integration_unavailable`, naming the integration. A tracker failing while
training (W&B unreachable) is logged in the worker's log and dropped: training goes on.
"""

from __future__ import annotations

import importlib
import logging
import os
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from service.jobs.spec import MethodBase
from service.models import Job

log = logging.getLogger("tunehouse.worker")

# the package each integration type needs on the worker, for the error when it is missing
PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboardX"}
# row keys that are not metrics: the step is W&B's x axis, the rest is bookkeeping
_NOT_LOGGED = frozenset({"step", "logged_at", "total_steps"})


class TrackerUnavailable(Exception):
    """The worker cannot run one of the job's integrations (package missing, run refused)."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


class Tracker(Protocol):
    def log(self, row: Mapping[str, float]) -> None: ...

    def finish(self, *, exit_code: int) -> None: ...


def _require(integration_type: str, index: int) -> ModuleType:
    package = PACKAGES[integration_type]
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise TrackerUnavailable(
            f"the '{integration_type}' integration needs the '{package}' package on the worker, which "
            "is not installed (the operator installs it with: pip install 'tunehouse[trackers]')",
            param=f"integrations[{index}]",
        ) from exc


def job_config(job: Job, method: MethodBase) -> dict[str, Any]:
    """What a tracker records as the run's config: the job's spec, hyperparameters resolved."""
    return {
        "job_id": job.id,
        "model": job.model,
        "method": method.type,
        "hyperparameters": method.hyperparameters.model_dump(mode="json"),
        "training_file": job.training_file,
        "validation_file": job.validation_file,
        "seed": job.seed,
        "suffix": job.suffix,
    }


class WandbRun:
    """One job's W&B run; `log` and `finish` never raise (a tracker must not fail the training)."""

    def __init__(self, run: Any, *, job_id: str) -> None:
        self.run, self.job_id = run, job_id
        self.broken: str | None = None  # why logging stopped, once it did

    @classmethod
    def start(cls, settings: Mapping[str, Any], *, index: int, job: Job, config: dict[str, Any]) -> WandbRun:
        wandb = _require("wandb", index)
        directory = None
        if not os.environ.get("WANDB_DIR"):
            from service.config import get_settings

            directory = Path(get_settings().data_dir)  # W&B writes under its `wandb/` folder
        # OpenAI adds "openai/finetune", "openai/{base-model}", "openai/{ftjob-id}"; W&B caps tags at 64
        tags = ["tunehouse/finetune", f"tunehouse/{job.model}"[:64], f"tunehouse/{job.id}"]
        try:
            run = wandb.init(
                project=settings["project"],
                entity=settings.get("entity"),
                name=settings.get("name") or job.id,
                tags=[*tags, *settings.get("tags", [])],
                config=config,
                id=job.id,
                resume="allow",
                dir=str(directory) if directory else None,
                settings=wandb.Settings(console="off", silent=True),
            )
        except Exception as exc:  # no API key, entity refused, ...: the deployment's side, said plainly
            raise TrackerUnavailable(
                f"could not start the W&B run: {type(exc).__name__}: {exc}", param=f"integrations[{index}]"
            ) from exc
        return cls(run, job_id=job.id)

    def log(self, row: Mapping[str, float]) -> None:
        if self.broken is not None:
            return
        try:
            # steps are W&B's own x axis: an evaluation row joins its training step's row
            self.run.log({k: v for k, v in row.items() if k not in _NOT_LOGGED}, step=int(row["step"]))
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            log.warning("job %s: W&B logging stopped: %s", self.job_id, self.broken)

    def finish(self, *, exit_code: int) -> None:
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as exc:
            log.warning("job %s: W&B run did not finish cleanly: %s", self.job_id, exc)


def open_trackers(job: Job, method: MethodBase) -> list[Tracker]:
    """The live trackers of the job; checks every integration's package first (before training)."""
    integrations: Sequence[Mapping[str, Any]] = job.integrations or []
    for i, integration in enumerate(integrations):
        _require(integration["type"], i)
    trackers: list[Tracker] = []
    for i, integration in enumerate(integrations):
        if integration["type"] == "wandb":
            trackers.append(
                WandbRun.start(integration["wandb"], index=i, job=job, config=job_config(job, method))
            )
    return trackers


def write_tensorboard(
    rows: Sequence[tuple[int, Mapping[str, Any]]], config: Mapping[str, Any], folder: Path
) -> None:
    """TensorBoard event files in ``folder``: a scalar per metric and step, and the config as text."""
    import json

    from tensorboardX import SummaryWriter

    with SummaryWriter(logdir=str(folder)) as writer:
        writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", global_step=0)
        for step, values in rows:
            for key, value in values.items():
                if key not in _NOT_LOGGED and isinstance(value, int | float):
                    writer.add_scalar(key, float(value), global_step=step)


def tar_events(folder: Path, dest: Path) -> None:
    with tarfile.open(dest, "w:gz") as tar:
        tar.add(folder, arcname="tensorboard")


def tensorboard_archive(job_id: str, scratch: Path) -> Path | None:
    """The job's metrics as a tar.gz of TensorBoard event files, if its spec asks for the `tensorboard`
    integration (a result file of the succeeded job); None otherwise."""
    from sqlalchemy import select

    from service.db import session_scope
    from service.jobs import repository
    from service.jobs.spec import load_method
    from service.models import JobMetric

    with session_scope() as session:
        job = repository.job(session, job_id)
        assert job is not None
        if not any(i["type"] == "tensorboard" for i in job.integrations or []):
            return None
        config = job_config(job, load_method(job.method))
        rows = [
            (m.step, dict(m.values))
            for m in session.scalars(
                select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.step)
            )
        ]
    folder = scratch / "tensorboard"
    write_tensorboard(rows, config, folder)
    dest = scratch / "tensorboard.tar.gz"
    tar_events(folder, dest)
    return dest
