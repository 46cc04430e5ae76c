"""The trainer process of a worker's LoRA jobs on one base model (started and fed by
worker/shared_runs.py): `python -m worker.job_process --shared-base WORKER_ID NOTICES`, or the worker's
spare trainer given the line `--shared-base WORKER_ID NOTICES` (worker/spare_trainer.py).

It holds the base once (trainers/families/shared_base.py) and runs each job in a thread of its own,
exactly as a lone trainer runs it (worker/job_process.py: inputs, reporter, checkpoints, outcome), the
jobs taking turns between optimizer steps. Commands, one per line on stdin:
- `run JOB_ID`: start the job (the worker holds its lease and heartbeats for it);
- `stop JOB_ID`: that job checkpoints at its next step and is handed back (its lease was lost);
end of input: no more jobs; the process exits once the running ones have ended.
When a job's thread has ended (its outcome recorded, its adapter gone) the process writes
`JOB_ID EXIT_CODE` to the named pipe NOTICES: 0 when the outcome was recorded, 1 when the thread died
before, which the worker treats as a lone trainer's crash (a restart from the job's checkpoint). Its
command line names the jobs it runs (`ps`, and the tests, find a job's trainer by it).

SIGTERM (the worker shutting down) makes every job checkpoint at its next step and hand itself back,
as it does a lone trainer; after settings.shutdown_grace_seconds the process ends itself. The process
dying (OOM, a kill) ends all its jobs at once: the worker restarts each from its own latest checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import shlex
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import BinaryIO

import setproctitle

from service.config import get_settings
from trainers.families.shared_base import SharedBase

RUN, STOP = "run", "stop"
_M_ARENA_MAX = -8  # glibc's mallopt parameter

# runs one job on the base in the calling thread (worker/job_process.py run_on_shared_base)
RunJob = Callable[[str, str, SharedBase, threading.Event], None]

log = logging.getLogger("tunehouse.worker")

RUN, STOP = "run", "stop"
_M_ARENA_MAX = -8  # glibc's mallopt parameter


class _Host:
    def __init__(self, worker_id: str, notices: BinaryIO, run_job: RunJob, title: list[str]) -> None:
        self.worker_id, self.notices, self.run_job, self.title = worker_id, notices, run_job, title
        self.base = SharedBase()
        self.stops: dict[str, threading.Event] = {}
        self.threads: list[threading.Thread] = []
        self.notice_lock = threading.Lock()
        self.stopping = False

    def run(self, job_id: str) -> None:
        stop = self.stops[job_id] = threading.Event()
        if self.stopping:
            stop.set()  # it starts, checkpoints nothing new and hands itself back at once
        thread = threading.Thread(target=self._train, args=(job_id, stop), name=f"job-{job_id}")
        self.threads.append(thread)
        self._retitle()
        thread.start()

    def stop(self, job_id: str) -> None:
        if job_id in self.stops:
            self.stops[job_id].set()

    def stop_all(self) -> None:
        self.stopping = True
        for stop in list(self.stops.values()):
            stop.set()

    def _train(self, job_id: str, stop: threading.Event) -> None:
        code = 1
        try:
            self.run_job(job_id, self.worker_id, self.base, stop)
            code = 0
        except BaseException:
            log.error(
                "job %s: its thread ended without recording an outcome:\n%s", job_id, traceback.format_exc()
            )
        finally:
            with self.notice_lock:
                self.stops.pop(job_id, None)
                self._retitle()
                self.notices.write(f"{job_id} {code}\n".encode())
                self.notices.flush()

    def _retitle(self) -> None:
        setproctitle.setproctitle(shlex.join([*self.title, *self.stops]))


def serve(worker_id: str, notices_path: str, run_job: RunJob, *, title: list[str]) -> None:
    """Be the shared-base trainer until stdin ends and the jobs have ended; `title`: the command line it
    shows, the running jobs' ids appended."""
    settings = get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    tempfile.tempdir = str(settings.data_dir)  # where the jobs' tokenized examples spill
    _one_malloc_arena()
    with open(notices_path, "wb", buffering=0) as notices:
        _serve(_Host(worker_id, notices, run_job, title), settings.shutdown_grace_seconds)


def _one_malloc_arena() -> None:
    """Make the job threads allocate from the heap the main thread uses. glibc gives each new thread an
    arena of its own, and a trainer keeps what it frees (worker/launch.py TRAINER_MALLOC_TUNABLES): each
    job's thread would then hold its own step's activations for good, and four jobs four working sets.
    They take turns, so one shared heap reuses one working set; they never allocate at the same time.
    (M_ARENA_MAX, before the threads start; no effect outside glibc.)"""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, 1)


def _serve(host: _Host, grace_seconds: float) -> None:

    def on_sigterm(_signum: int, _frame: object) -> None:
        if not host.stopping:
            host.stop_all()
            signal.alarm(max(1, math.ceil(grace_seconds)))  # a backstop for when no supervisor is left

    signal.signal(signal.SIGTERM, on_sigterm)
    for line in sys.stdin:
        words = line.split()
        if len(words) != 2 or words[0] not in (RUN, STOP):
            log.error("shared base host: unknown command %r", line)
            continue
        if words[0] == RUN:
            host.run(words[1])
        else:
            host.stop(words[1])
    for thread in host.threads:
        thread.join()
