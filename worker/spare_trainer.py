"""A trainer process started before its job, so that a job's start does not wait for an interpreter to
start and import torch, transformers and the trainers (~5 s and ~400 MB on a 2-core CPU, each job).

A worker keeps at most one spare: `python -m worker.job_process --spare`, which imports what a job
needs and then blocks on its stdin. A one-rank job is handed to it as one line, "JOB_ID WORKER_ID"; the
spare then is that job's trainer, exactly as a fresh `python -m worker.job_process JOB_ID WORKER_ID`
would be (one job per process still: it exits when the job ends). The worker starts the next spare as
soon as a trainer exits, while it records the outcome and claims the next job. A spare that died
while idle (OOM-killed, say) is replaced by a fresh process for the job: nothing depends on it.
Multi-rank jobs start their launcher as before. Closing a spare's stdin without a job id ends it.

Off with `TUNEHOUSE_SPARE_TRAINER=false` (a worker that must not hold ~400 MB while idle)."""

from __future__ import annotations

import logging
import subprocess
import sys

from worker.launch import HOST_FLAG, TRAINER_MODULE, start_trainer

log = logging.getLogger("tunehouse.worker")

SPARE_FLAG = "--spare"
SPARE_COMMAND = [sys.executable, "-m", TRAINER_MODULE, SPARE_FLAG]


class SpareTrainer:
    """This worker's idle trainer process, if any."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start a spare unless one is there (alive or still importing)."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self._proc = start_trainer(SPARE_COMMAND, stdin=subprocess.PIPE)

    def take(self, job_id: str, worker_id: str) -> subprocess.Popen[bytes] | None:
        """The spare, now training `job_id` for `worker_id`; None if there is none alive to take it."""
        return self._give(f"{job_id} {worker_id}", job_id, keep_stdin=False)

    def take_as_shared_base(self, worker_id: str, notices: str) -> subprocess.Popen[bytes] | None:
        """The spare, now a shared-base trainer (worker/shared_base_host.py) whose stdin stays open for its
        commands; None if there is none alive to take it."""
        return self._give(f"{HOST_FLAG} {worker_id} {notices}", "a shared base", keep_stdin=True)

    def _give(self, line: str, what: str, *, keep_stdin: bool) -> subprocess.Popen[bytes] | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        assert proc.stdin is not None
        try:
            if proc.poll() is None:
                proc.stdin.write(f"{line}\n".encode())
                if keep_stdin:
                    proc.stdin.flush()
                else:
                    proc.stdin.close()
                return proc
            why = f"exited with {proc.returncode}"
        except OSError as exc:  # BrokenPipeError: it died since
            why = str(exc)
        log.warning("spare trainer %s is gone (%s); %s starts a fresh one", proc.pid, why, what)
        proc.kill()
        proc.wait()
        return None

    def stop(self) -> None:
        """End the idle spare (the worker is stopping): its stdin closes, it exits without a job."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        assert proc.stdin is not None
        try:
            proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
