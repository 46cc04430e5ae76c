"""A DPO job's precomputed reference log-probs, kept in the blob store next to its training file: the
job process fetches them before the run and stores them back when its trainer added an entry (before
its first step, and after the run), so the next job on the file (a sweep, a resumed or requeued job,
one whose worker died) skips the reference's pass over the pairs.
The entries and their keys are ``trainers.families.reference_cache``'s; the blob goes when the file is deleted
(``service.files.service.delete_file``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
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


@dataclass
class KeptLogProbs:
    """A job's local copy of its training file's kept log-probs (``path``, which the trainer reads and
    rewrites) and the blob it was fetched from and is stored back to."""

    blobs: BlobStore
    tenant_id: str
    file_id: str
    path: Path
    stored: Stamp  # the local file's stamp when it last matched the blob (fetched or uploaded)

    def store_if_changed(self) -> None:
        """Upload the local file if the trainer rewrote it since it last matched the blob. Called once
        the trainer's pass is done, before its first step (a worker that dies later keeps them), and
        again after the run. A failure is logged, not raised: the log-probs are a saving for later jobs,
        not this job's result; the next call tries again.

        A file deleted while the job ran must not get them back: after the upload, the file's row is
        read, and the blob goes again if the row is gone (or cannot be read). ``delete_file`` removes
        the row before the blob, so whichever of the two deletions comes last finds what the other
        left."""
        now = stamp(self.path)
        if now is None or now == self.stored:
            return
        key = reference_log_probs_key(self.tenant_id, self.file_id)
        try:
            self.blobs.put_file(key, self.path)
        except Exception as exc:
            log.warning("reference log-probs of file %s not kept for later jobs: %s", self.file_id, exc)
            return
        self.stored = now
        try:
            with session_scope() as session:
                kept = session.get(File, self.file_id) is not None
        except Exception as exc:
            log.warning("reference log-probs of file %s: row not read, blob deleted: %s", self.file_id, exc)
            kept = False
        if not kept:
            try:
                self.blobs.delete(key)
            except Exception as exc:  # an orphan until the blob store is back; nothing points at it
                log.warning("reference log-probs of file %s: blob %s not deleted: %s", self.file_id, key, exc)
