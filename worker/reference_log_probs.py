"""A DPO job's precomputed reference log-probs, kept in the blob store next to its training file: the
job process fetches them before the run and stores them back when its trainer added an entry, so the
next job on the file (a sweep, a resumed or requeued job) skips the reference's pass over the pairs.
The entries and their keys are ``trainers.reference_cache``'s; the blob goes when the file is deleted
(``service.files.service.delete_file``)."""

from __future__ import annotations

import logging
from pathlib import Path

from service.db import session_scope
from service.files.service import reference_log_probs_key
from service.models import File
from service.storage import BlobStore

log = logging.getLogger("tunehouse.worker")

Stamp = tuple[int, int] | None  # (inode, mtime in ns) of the local file; None: there is none


def fetch(blobs: BlobStore, *, tenant_id: str, file_id: str, dest: Path) -> None:
    """Copy the file's kept log-probs to ``dest``; leave no ``dest`` if there are none."""
    try:
        with dest.open("wb") as fh:
            blobs.copy_to(reference_log_probs_key(tenant_id, file_id), fh)
    except FileNotFoundError:
        dest.unlink(missing_ok=True)


def stamp(path: Path | None) -> Stamp:
    if path is None:
        return None
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def store_if_changed(blobs: BlobStore, *, tenant_id: str, file_id: str, source: Path, fetched: Stamp) -> None:
    """Upload ``source`` if the trainer rewrote it since the fetch (``fetched``: its stamp then). A
    failure is logged, not raised: the log-probs are a saving for later jobs, not this job's result.

    A file deleted while the job ran must not get them back: after the upload, the file's row is read,
    and the blob goes again if the row is gone (or cannot be read). ``delete_file`` removes the row
    before the blob, so whichever of the two deletions comes last finds what the other left."""
    now = stamp(source)
    if now is None or now == fetched:
        return
    key = reference_log_probs_key(tenant_id, file_id)
    try:
        blobs.put_file(key, source)
        with session_scope() as session:
            kept = session.get(File, file_id) is not None
    except Exception as exc:
        log.warning("reference log-probs of file %s not kept for later jobs: %s", file_id, exc)
        kept = False
    if not kept:
        try:
            blobs.delete(key)
        except Exception as exc:  # an orphan until the blob store is back; nothing points at it
            log.warning("reference log-probs of file %s: blob %s not deleted: %s", file_id, key, exc)
