"""A host's disk cache of the catalogue's base models (service/base_models/adding.py stores them in the
blob store): fetched on first use, checked file by file against their sha256, kept under
`<data dir>/models/base/` up to `TUNEHOUSE_MODEL_CACHE_GB`, least recently used evicted first.

Several workers of one host share the cache without fetching the same files twice: the first takes the
model's lock exclusively and downloads, the others wait on the lock and find the model complete. Every
process that resolved a model holds a shared lock on it for as long as it lives (a trainer, an inference
worker, a Tinker host), so eviction, which needs the lock exclusively, never removes a model in use.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from service.storage import BlobStore

log = logging.getLogger("tunehouse.models")

COMPLETE = ".complete"  # written last: the folder holds every file, each checked
CHUNK = 1024 * 1024
# the shared locks this process holds on the models it uses, kept open until it exits
_IN_USE: dict[Path, IO[str]] = {}


class ChecksumMismatch(Exception):
    pass


def entry_dir(cache_root: Path, name: str, revision: str) -> Path:
    return cache_root / f"{name.replace('/', '--')}@{revision[:16]}"


def _lock_file(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.lock"


def _download(blobs: BlobStore, prefix: str, files: list[dict[str, Any]], into: Path) -> None:
    for entry in files:
        target = into / entry["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        with target.open("wb") as out:
            for chunk in blobs.iter_bytes(f"{prefix}/{entry['path']}", CHUNK):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != entry["sha256"]:
            raise ChecksumMismatch(
                f"{entry['path']}: sha256 {digest.hexdigest()} in the blob store, {entry['sha256']} recorded"
            )


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def evict(cache_root: Path, cap_bytes: int, keep: Path) -> list[Path]:
    """Remove the least recently used complete models not in use by any process until the cache is
    within `cap_bytes` (`keep`, just fetched, stays even when it alone is larger); returns what went."""
    entries = [p for p in cache_root.iterdir() if p.is_dir() and (p / COMPLETE).exists()]
    sizes = {p: _size(p) for p in entries}
    total = sum(sizes.values())
    removed = []
    for folder in sorted(entries, key=lambda p: (p / COMPLETE).stat().st_mtime):
        if total <= cap_bytes:
            break
        if folder == keep:
            continue
        with _lock_file(folder).open("a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a process is using it
            shutil.rmtree(folder)
        total -= sizes[folder]
        removed.append(folder)
        log.info(
            "model cache: evicted %s (%.1f MB) to stay under the cap", folder.name, sizes[folder] / 2**20
        )
    return removed


def fetch_base_model(
    blobs: BlobStore,
    cache_root: Path,
    *,
    name: str,
    revision: str,
    prefix: str,
    files: list[dict[str, Any]],
    cap_bytes: int,
) -> Path:
    """The model's local folder, fetched once per host; held in use by this process from now on."""
    folder = entry_dir(cache_root, name, revision)
    cache_root.mkdir(parents=True, exist_ok=True)
    lock = _IN_USE.get(folder) or _lock_file(folder).open("a")
    fcntl.flock(lock, fcntl.LOCK_EX)  # one fetcher per host; the others wait here
    try:
        if not (folder / COMPLETE).exists():
            _fetch(blobs, folder, name=name, revision=revision, prefix=prefix, files=files)
            evict(cache_root, cap_bytes, keep=folder)
        os.utime(folder / COMPLETE)  # used now: the LRU order
    except BaseException:
        if folder not in _IN_USE:
            lock.close()
        raise
    fcntl.flock(lock, fcntl.LOCK_SH)  # in use by this process until it exits
    _IN_USE[folder] = lock
    return folder


def _fetch(
    blobs: BlobStore, folder: Path, *, name: str, revision: str, prefix: str, files: list[dict[str, Any]]
) -> None:
    """Download into a temporary folder beside `folder`, check, then rename: never a partial model."""
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".fetch-"))
    try:
        _download(blobs, prefix, files, tmp)
        shutil.rmtree(folder, ignore_errors=True)
        (tmp / COMPLETE).write_text(revision + "\n")
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("model cache: fetched %s@%s in %.1fs", name, revision[:12], time.monotonic() - started)
