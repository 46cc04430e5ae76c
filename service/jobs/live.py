"""The live path's publishing side: one Redis channel per job, which SSE streams subscribe to.

Two kinds of message go on a job's channel:
- a metric row (it has a "step"), published by the worker's reporter the moment the trainer logs it;
- a nudge (`NUDGE`, no "step"), published once a transaction that added an event to the job has
  committed: the job's streams read the DB at once instead of at their next catch-up read
  (service/jobs/stream.py), so a state change, a checkpoint or the job's end reaches a client (and
  `jobs.wait()` returns) as soon as it is stored. Step events are the exception: their rows already
  travel live, and a nudge per flush would double every stream's DB reads.

Nudges are best effort, like the whole live path: they are sent from a thread of their own, so a commit
never waits on Redis (a request's or the training loop's), and a lost one costs a client at most a
catch-up interval. Redis is optional: without a URL nothing is sent.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections import deque
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from service.config import get_settings

log = logging.getLogger("tunehouse.live")

# a publish to a Redis that hangs (stopped, not closed) gives up after this long: a reporter's DB
# flushes wait behind it, so without a timeout a hung Redis would stop a job's metrics reaching the DB
PUBLISH_TIMEOUT_SECONDS = 2.0
# after a failed publish, a publisher rests this long: a down Redis must not cost every step a retry
PUBLISH_RETRY_SECONDS = 2.0
NUDGE = json.dumps({"nudge": True})
# the jobs whose events a session added since its transaction began (Session.info key)
_NUDGE_JOBS = "tunehouse.nudge_jobs"
# at exit, how long a process waits for its last nudges (a job's end among them) to go out
_EXIT_DRAIN_SECONDS = 1.0


def channel(job_id: str) -> str:
    return f"tunehouse:job:{job_id}"


def live_publisher(redis_url: str) -> Any:
    """The Redis client the live path publishes with: bounded waits, no retries of its own (a row or a
    nudge it could not publish is dropped; the DB is the record)."""
    import redis

    return redis.Redis.from_url(
        redis_url,
        socket_connect_timeout=PUBLISH_TIMEOUT_SECONDS,
        socket_timeout=PUBLISH_TIMEOUT_SECONDS,
        retry=None,
    )


def nudge_after_commit(session: Session, job_id: str) -> None:
    """Nudge the job's streams once this session's transaction commits (never if it rolls back)."""
    session.info.setdefault(_NUDGE_JOBS, set()).add(job_id)


@event.listens_for(Session, "after_commit")
def _send_nudges(session: Session) -> None:
    jobs = session.info.pop(_NUDGE_JOBS, None)
    if jobs:
        _nudger().send(jobs)


@event.listens_for(Session, "after_rollback")
def _drop_nudges(session: Session) -> None:
    session.info.pop(_NUDGE_JOBS, None)


class _Nudger:
    """This process's sender thread: it publishes the nudges commits hand it, in order."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.pending: deque[str] = deque(maxlen=10_000)  # bounded: a long outage drops the oldest
        self.wake = threading.Condition()
        self.client: Any = None
        self.retry_at = 0.0
        self.busy = False
        self.thread = threading.Thread(target=self._run, name="live-nudges", daemon=True)
        self.thread.start()

    def send(self, jobs: set[str]) -> None:
        with self.wake:
            self.pending.extend(jobs)
            self.wake.notify_all()

    def drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.wake:
            while (self.pending or self.busy) and (left := deadline - time.monotonic()) > 0:
                self.wake.wait(left)

    def _run(self) -> None:
        while True:
            with self.wake:
                while not self.pending:
                    self.busy = False
                    self.wake.notify_all()  # a drain waiting for the queue to empty
                    self.wake.wait()
                jobs, self.busy = list(dict.fromkeys(self.pending)), True
                self.pending.clear()
            if time.monotonic() < self.retry_at:
                continue  # Redis failed a moment ago: the streams' catch-up reads find these events
            try:
                if self.client is None:
                    self.client = live_publisher(self.redis_url)
                pipe = self.client.pipeline(transaction=False)
                for job_id in jobs:
                    pipe.publish(channel(job_id), NUDGE)
                pipe.execute()
            except Exception as exc:  # best effort: the DB has the events
                self.retry_at = time.monotonic() + PUBLISH_RETRY_SECONDS
                log.warning("could not nudge the live streams of %d job(s): %s", len(jobs), exc)


_state: dict[str, Any] = {}


def _nudger() -> _Nudger | _NoNudger:
    """The process's nudger, started on first use; a forked child (a Celery pool process) gets its own."""
    redis_url = get_settings().redis_url
    key = (os.getpid(), redis_url)
    if _state.get("key") != key:
        _state["key"] = key
        _state["nudger"] = _Nudger(redis_url) if redis_url else _NoNudger()
    nudger: _Nudger | _NoNudger = _state["nudger"]
    return nudger


class _NoNudger:
    """Without Redis there is no live path: streams poll the DB."""

    def send(self, jobs: set[str]) -> None:
        pass

    def drain(self, timeout: float) -> None:
        pass


@atexit.register
def _drain_at_exit() -> None:
    nudger = _state.get("nudger")
    if nudger is not None and _state.get("key", (None,))[0] == os.getpid():
        nudger.drain(_EXIT_DRAIN_SECONDS)
