"""A DPO job's kept reference log-probs (worker/reference_log_probs.py): fetched when the file has them,
stored back only when the trainer rewrote them, and never left behind for a file deleted meanwhile."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np

from service.files.service import reference_log_probs_key
from service.storage.local import LocalBlobStore
from tests.helpers import tenant_of, upload_ok
from trainers.families.reference_cache import ReferenceCache
from worker import reference_log_probs

ROWS = [{"prompt": "Is Lima a city?", "chosen": " Yes.", "rejected": " No."}] * 4


def test_stored_when_rewritten_fetched_by_the_next_job_and_gone_with_a_deleted_file(
    client: httpx.Client, api_key: str, tmp_path: Path
) -> None:
    blobs = LocalBlobStore(tmp_path / "blobs")
    tenant, file_id = tenant_of(api_key), upload_ok(client, ROWS)
    key = reference_log_probs_key(tenant, file_id)
    first = tmp_path / "job1.npz"
    reference_log_probs.fetch(blobs, tenant_id=tenant, file_id=file_id, dest=first)
    assert not first.exists()  # nothing kept yet

    def kept(path: Path) -> reference_log_probs.KeptLogProbs:
        stamp = reference_log_probs.stamp(path)
        return reference_log_probs.KeptLogProbs(blobs, tenant, file_id, path, stored=stamp)

    def blob_files() -> list[Path]:
        return list((tmp_path / "blobs").rglob("*.npz")) if (tmp_path / "blobs").exists() else []

    job1 = kept(first)
    job1.store_if_changed()
    assert blob_files() == []  # nothing to store

    ReferenceCache(first).save("k", np.array([[-1.0, -2.0]]))
    job1.store_if_changed()  # the trainer's pass is done: stored before its first step
    assert blobs.size(key) > 0
    blobs.delete(key)
    job1.store_if_changed()  # after the run: nothing new since, nothing stored again
    assert blob_files() == []
    ReferenceCache(first).save("k", np.array([[-1.0, -2.0]]))
    job1.store_if_changed()

    second = tmp_path / "job2.npz"
    reference_log_probs.fetch(blobs, tenant_id=tenant, file_id=file_id, dest=second)
    assert ReferenceCache(second).load("k", 1).tolist() == [[-1.0, -2.0]]  # type: ignore[union-attr]
    job2 = kept(second)
    blobs.delete(key)  # the next job read them and added nothing: nothing is uploaded again
    job2.store_if_changed()
    assert blob_files() == []

    # the file is deleted while a job runs: the job's upload must not bring its derived data back
    assert client.delete(f"/v1/files/{file_id}").status_code == 200
    ReferenceCache(second).save("k2", np.array([[-3.0, -4.0]]))
    job2.store_if_changed()
    assert blob_files() == []


def test_an_upload_that_failed_is_tried_again_at_the_next_call(
    client: httpx.Client, api_key: str, tmp_path: Path
) -> None:
    blobs = LocalBlobStore(tmp_path / "blobs")
    tenant, file_id = tenant_of(api_key), upload_ok(client, ROWS)
    local = tmp_path / "job.npz"
    kept = reference_log_probs.KeptLogProbs(blobs, tenant, file_id, local, stored=None)
    ReferenceCache(local).save("k", np.array([[-1.0, -2.0]]))
    in_the_way = tmp_path / "blobs" / "files" / tenant  # a file where the blob's folder must go
    in_the_way.parent.mkdir(parents=True)
    in_the_way.write_text("")
    kept.store_if_changed()  # before the first step: the upload fails, logged, not raised
    in_the_way.unlink()
    kept.store_if_changed()  # after the run
    assert blobs.size(reference_log_probs_key(tenant, file_id)) > 0
