"""Riding out a PostgreSQL or blob store outage in the worker: what counts as one, and a bounded retry.

A restarted or failed-over database cuts every connection; the pool's pre-ping then reconnects once
the server is back. The trainer should not die for a blip: metric rows wait in the reporter's buffer,
and the few writes that must land (an event, a checkpoint record, the final status) retry here until
the database answers again or `db_outage_tolerance_seconds` have passed.

The blob store (S3) gets the same treatment for reading a dataset, restoring a checkpoint and
uploading one (`blob_outage_tolerance_seconds`); the caller is told when the first retry starts, so
the job's events say why it is waiting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import DBAPIError

from service.db import DB_UNAVAILABLE_ERRORS
from service.storage import BlobStoreUnavailable

log = logging.getLogger("tunehouse.worker")

T = TypeVar("T")

MAX_BACKOFF_SECONDS = 2.0


def is_outage(exc: BaseException) -> bool:
    """The database is unreachable (connection refused, cut, or shut down), not a bad statement."""
    if isinstance(exc, DB_UNAVAILABLE_ERRORS):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def _retry(
    fn: Callable[[], T],
    *,
    transient: Callable[[BaseException], bool],
    what: str,
    tolerance: float,
    on_first_retry: Callable[[BaseException], None] | None = None,
) -> T:
    deadline = time.monotonic() + tolerance
    delay = 0.1
    retried = False
    while True:
        try:
            return fn()
        except Exception as exc:
            if not transient(exc) or time.monotonic() + delay > deadline:
                raise
            log.warning("%s: %s (retrying)", what, exc)
            if not retried and on_first_retry is not None:
                on_first_retry(exc)
            retried = True
        time.sleep(delay)
        delay = min(delay * 2, MAX_BACKOFF_SECONDS)


def retry_db(fn: Callable[[], T], *, what: str, tolerance: float) -> T:
    """`fn()`, retried with backoff while the database is unreachable, for at most `tolerance` seconds."""
    return _retry(fn, transient=is_outage, what=what, tolerance=tolerance)


def retry_blob(
    fn: Callable[[], T],
    *,
    what: str,
    tolerance: float,
    on_first_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """`fn()`, retried with backoff while the blob store is unavailable, for at most `tolerance` seconds;
    then its BlobStoreUnavailable goes up."""

    def transient(exc: BaseException) -> bool:
        return isinstance(exc, BlobStoreUnavailable)

    return _retry(fn, transient=transient, what=what, tolerance=tolerance, on_first_retry=on_first_retry)


def blob_outage_event(job_id: str, exc: BaseException, tolerance: float) -> None:
    """The job's event for a blob store outage it is waiting out (best effort: the DB may be down too)."""
    from service.db import session_scope
    from service.jobs.events import add_event

    detail = exc.detail if isinstance(exc, BlobStoreUnavailable) else type(exc).__name__
    try:
        with session_scope() as session:
            add_event(
                session,
                job_id,
                f"The blob store is unavailable ({detail}); the worker retries for up to {tolerance:g} s",
                level="warn",
                data={"kind": "job.blob_store_unavailable"},
            )
    except Exception as event_exc:
        log.warning("job %s: no event for the blob store outage: %s", job_id, event_exc)
