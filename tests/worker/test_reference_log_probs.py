"""A DPO job's kept reference log-probs (worker/reference_log_probs.py): fetched when the file has them,
stored back only when the trainer rewrote them, and never left behind for a file deleted meanwhile."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np

from service.files.service import reference_log_probs_key
from service.storage.local import LocalBlobStore
from tests.helpers import tenant_of, upload_ok
from trainers.reference_cache import ReferenceCache
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
    fetched = reference_log_probs.stamp(first)
    reference_log_probs.store_if_changed(
        blobs, tenant_id=tenant, file_id=file_id, source=first, fetched=fetched
    )
    assert not (tmp_path / "blobs").exists() or not any(
        (tmp_path / "blobs").rglob("*.npz")
    )  # nothing to store

    ReferenceCache(first).save("k", np.array([[-1.0, -2.0]]))
    reference_log_probs.store_if_changed(
        blobs, tenant_id=tenant, file_id=file_id, source=first, fetched=fetched
    )
    assert blobs.size(key) > 0

    second = tmp_path / "job2.npz"
    reference_log_probs.fetch(blobs, tenant_id=tenant, file_id=file_id, dest=second)
    assert ReferenceCache(second).load("k", 1).tolist() == [[-1.0, -2.0]]  # type: ignore[union-attr]
    blobs.delete(key)  # the next job read them and added nothing: nothing is uploaded again
    reference_log_probs.store_if_changed(
        blobs, tenant_id=tenant, file_id=file_id, source=second, fetched=reference_log_probs.stamp(second)
    )
    assert not any((tmp_path / "blobs").rglob("*.npz"))

    # the file is deleted while a job runs: the job's upload must not bring its derived data back
    assert client.delete(f"/v1/files/{file_id}").status_code == 200
    ReferenceCache(second).save("k2", np.array([[-3.0, -4.0]]))
    reference_log_probs.store_if_changed(
        blobs, tenant_id=tenant, file_id=file_id, source=second, fetched=None
    )
    assert not any((tmp_path / "blobs").rglob("*.npz"))
