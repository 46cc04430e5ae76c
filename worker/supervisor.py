"""Runs one job: claim the lease, start a fresh trainer process, heartbeat while it lives.

Why a child process per job: accelerate and CUDA keep process-global state, a trainer that crashes
(or is OOM-killed) must not take the worker with it, and the parent can still record a system failure.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from sqlalchemy import select

from service.config import get_settings
from service.db import session_scope
from service.jobs.events import add_event
from service.models import Job
from worker import lease

log = logging.getLogger("tunehouse.worker")

# how long a child may keep running after we lost the lease (cancel, takeover) before we kill it
LOST_LEASE_GRACE_SECONDS = 30.0


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _die_with_parent() -> None:
    # Linux: the trainer gets SIGTERM if the worker process dies, so no orphan keeps the GPU.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def supervise_job(job_id: str, *, worker_id: str | None = None) -> str | None:
    """Run the job to its end if we can claim it; returns the job's final status, or None if not ours."""
    settings = get_settings()
    worker_id = worker_id or default_worker_id()
    with session_scope() as session:
        job = session.get(Job, job_id)
        if job is None or job.status in ("succeeded", "failed", "cancelled", "paused"):
            return None
        if not lease.claim(
            session, job_id=job_id, worker_id=worker_id, lease_timeout=settings.lease_timeout_seconds
        ):
            log.info("job %s is held by a live worker or not runnable; skipping", job_id)
            return None
        attempt = session.scalar(select(Job.attempts).where(Job.id == job_id))
        add_event(session, job_id, f"Job started on worker {worker_id} (attempt {attempt})")

    cmd = [sys.executable, "-m", "worker.job_process", job_id, worker_id]
    proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
    lost_since: float | None = None
    last_beat = time.monotonic()
    while proc.poll() is None:
        time.sleep(0.2)
        if time.monotonic() - last_beat < settings.heartbeat_seconds:
            continue
        last_beat = time.monotonic()
        if lost_since is None or time.time() - lost_since < LOST_LEASE_GRACE_SECONDS:
            with session_scope() as session:
                held = lease.heartbeat(session, job_id=job_id, worker_id=worker_id)
            if not held and lost_since is None:
                lost_since = time.time()
        else:
            log.warning(
                "job %s: lease lost %.0fs ago and the trainer is still running; killing it",
                job_id,
                LOST_LEASE_GRACE_SECONDS,
            )
            proc.kill()
    if proc.returncode != 0:
        with session_scope() as session:
            error = {
                "code": "internal_error",
                "message": f"the trainer process exited with code {proc.returncode}",
                "param": None,
                "fault": "system",
            }
            if lease.finish(session, job_id=job_id, worker_id=worker_id, status="failed", error=error):
                add_event(session, job_id, f"Job failed: {error['message']}", level="error")
    with session_scope() as session:
        return session.scalar(select(Job.status).where(Job.id == job_id))
