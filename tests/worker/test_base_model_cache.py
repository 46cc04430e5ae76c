"""A host's cache of the catalogue's base models (worker/base_model_cache.py): two processes of one host
fetch a model once, every file is checked against its sha256, and eviction drops the least recently used
model that no process uses, never one in use."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from service.storage import LocalBlobStore
from worker.base_model_cache import COMPLETE, ChecksumMismatch, entry_dir, evict, fetch_base_model


def _store(blobs: LocalBlobStore, name: str, size: int) -> dict[str, Any]:
    data = hashlib.sha256(name.encode()).digest() * (size // 32)
    with blobs.writer(f"base-models/{name}/rev/w.bin") as w:
        w.write(data)
    files = [{"path": "w.bin", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    return {"name": name, "revision": "rev" + name, "prefix": f"base-models/{name}/rev", "files": files}


def _fetch_in_a_process(blob_root: Path, cache: Path, model: dict[str, Any], hold: bool = False) -> str:
    code = f"""
        import logging, sys, time
        from pathlib import Path
        from service.storage import LocalBlobStore
        from worker.base_model_cache import fetch_base_model
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        fetch_base_model(LocalBlobStore(Path({str(blob_root)!r})), Path({str(cache)!r}), cap_bytes=10**9,
                         **{model!r})
        print("ready", flush=True)
        if {hold!r}:
            sys.stdin.read()  # holds the model in use until the test closes stdin
    """
    return textwrap.dedent(code)


def test_two_processes_of_a_host_fetch_a_model_once(tmp_path: Path) -> None:
    blobs = LocalBlobStore(tmp_path / "blobs")
    model = _store(blobs, "m1", 4 * 2**20)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _fetch_in_a_process(tmp_path / "blobs", tmp_path / "cache", model)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert sum(out.count("model cache: fetched m1") for out in outputs) == 1, outputs
    folder = entry_dir(tmp_path / "cache", "m1", model["revision"])
    assert (folder / "w.bin").stat().st_size == 4 * 2**20 and (folder / COMPLETE).exists()


def test_a_file_that_does_not_match_its_sha256_is_refused(tmp_path: Path) -> None:
    blobs = LocalBlobStore(tmp_path / "blobs")
    model = _store(blobs, "m1", 1024)
    model["files"][0]["sha256"] = "0" * 64
    with pytest.raises(ChecksumMismatch, match=r"w\.bin: sha256"):
        fetch_base_model(blobs, tmp_path / "cache", cap_bytes=10**9, **model)
    assert not entry_dir(tmp_path / "cache", "m1", model["revision"]).exists()
    assert not list((tmp_path / "cache").glob(".fetch-*"))


def test_eviction_drops_the_least_recently_used_model_no_process_uses(tmp_path: Path) -> None:
    blobs = LocalBlobStore(tmp_path / "blobs")
    cache = tmp_path / "cache"
    m1, m2, m3 = (_store(blobs, name, 2**20) for name in ("m1", "m2", "m3"))
    # m1 in use by another process of the host for the whole test
    holder = subprocess.Popen(
        [sys.executable, "-c", _fetch_in_a_process(tmp_path / "blobs", cache, m1, hold=True)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and "ready" in holder.stdout.readline() + holder.stdout.readline()
        # this process fetches m2, then uses it no more (its lock released as a finished process's is)
        fetch_base_model(blobs, cache, cap_bytes=10**9, **m2)
        from worker import base_model_cache

        base_model_cache._IN_USE.pop(entry_dir(cache, "m2", m2["revision"])).close()
        # m3 takes the cache past a 2.5 MB cap: m1 is older but in use, so m2 goes
        fetch_base_model(blobs, cache, cap_bytes=int(2.5 * 2**20), **m3)
        assert not entry_dir(cache, "m2", m2["revision"]).exists()
        assert (
            entry_dir(cache, "m1", m1["revision"]).exists()
            and entry_dir(cache, "m3", m3["revision"]).exists()
        )
        # with nothing evictable (m1 held by the other process, m3 by this one) the cap is exceeded, not
        # enforced on a model in use
        assert evict(cache, 2**20, keep=entry_dir(cache, "m3", m3["revision"])) == []
    finally:
        holder.communicate(input="", timeout=60)
