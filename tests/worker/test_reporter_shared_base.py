"""The reporter of a job on a shared base (trainers/families/shared_base.py) lets the other jobs train
while it stores a checkpoint."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from service.db import session_scope
from service.models import Checkpoint
from service.storage import LocalBlobStore
from tests.worker.test_reporter_restart import _reporter, _running_job
from trainers.core import turns
from trainers.core.callbacks import CheckpointInfo


def test_a_checkpoint_uploads_away_from_the_shared_model(tmp_path: Path) -> None:
    """On a shared base (trainers/families/shared_base.py) the other jobs train while this one's
    checkpoint uploads: the reporter stores it inside ``turns.away()``, and takes the turn back after."""
    job_id = _running_job()
    log: list[str] = []

    class Turn:
        def leave(self) -> None:
            log.append("leave")

        def retake(self) -> None:
            log.append("retake")

    class Store(LocalBlobStore):
        def put_file(self, key: str, source: Path) -> None:
            log.append("upload")
            super().put_file(key, source)

    reporter = _reporter(job_id, tmp_path)
    reporter.blobs = Store(tmp_path / "blobs")
    ckpt = tmp_path / "ckpt"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "model" / "adapter_model.safetensors").write_bytes(b"weights")
    turns.set_turn(Turn())
    try:
        reporter.on_checkpoint(CheckpointInfo(path=ckpt, step=3, epoch=0.5, final=False))
    finally:
        turns.set_turn(None)
    assert log == ["leave", "upload", "retake"]
    with session_scope() as session:
        stored = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)).one()
    assert stored.step == 3
