"""The live path's publishing side: one Redis channel per job, which SSE streams subscribe to.

Two kinds of message go on a job's channel:
- metric rows (`rows_message`), published by the worker's reporter as the trainer logs them: at once,
  or, when steps come faster than `LIVE_BATCH_SECONDS`, the steps since its last publish in one
  message, so a fast loop costs the trainer, Redis and every stream one message a tenth of a second
  rather than one a step;
- a nudge (`NUDGE`, no rows), published once a transaction that added an event to the job has
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
from collections.abc import Mapping, Sequence
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
# a reporter publishes at most this often; rows logged in between wait for its next publish
LIVE_BATCH_SECONDS = 0.1
NUDGE = json.dumps({"nudge": True})
# the jobs whose events a session added since its transaction began (Session.info key)
_NUDGE_JOBS = "tunehouse.nudge_jobs"
# at exit, how long a process waits for its last nudges (a job's end among them) to go out
_EXIT_DRAIN_SECONDS = 1.0


def channel(job_id: str) -> str:
    return f"tunehouse:job:{job_id}"


def rows_message(rows: Sequence[Mapping[str, float]]) -> str:
    """A message of metric rows, in step order. Each row's step is an integer; total_steps rides along
    so a live client can draw progress before it has read any event."""
    return json.dumps({"rows": [{**row, "step": int(row["step"])} for row in rows]})


def message_rows(message: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The metric rows of a message read from a job's channel; None for a nudge."""
    rows = message.get("rows")
    return None if rows is None else list(rows)


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
_state_lock = threading.Lock()  # the API commits from several threads: one nudger per process


def _nudger() -> _Nudger | _NoNudger:
    """The process's nudger, started on first use."""
    redis_url = get_settings().redis_url
    with _state_lock:
        if _state.get("redis_url") != redis_url or "nudger" not in _state:
            _state["redis_url"] = redis_url
            _state["nudger"] = _Nudger(redis_url) if redis_url else _NoNudger()
        nudger: _Nudger | _NoNudger = _state["nudger"]
    return nudger


def _forget_after_fork() -> None:
    """A forked child (a Celery pool process) has no sender thread, and the lock may have been held
    by another of its parent's threads: it starts afresh."""
    global _state_lock
    _state_lock = threading.Lock()
    _state.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


class _NoNudger:
    """Without Redis there is no live path: streams poll the DB."""

    def send(self, jobs: set[str]) -> None:
        pass

    def drain(self, timeout: float) -> None:
        pass


@atexit.register
def _drain_at_exit() -> None:
    nudger = _state.get("nudger")
    if nudger is not None:
        nudger.drain(_EXIT_DRAIN_SECONDS)
