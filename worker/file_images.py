"""The images a training file fetched for its http(s) image URLs at upload (service/files/images.py keeps
them with the file), copied into a folder of a job's or an estimate's own, with the index the trainers
read them by (``trainers.data.vision.ImageFiles``)."""

from __future__ import annotations

import json
from pathlib import Path

from service.files.images import fetched_key, read_manifest
from service.storage import BlobStore
from trainers.data.vision import INDEX_FILE


def fetched_images(blobs: BlobStore, blob_keys: list[str], *, workdir: Path) -> Path | None:
    """The images of the files at ``blob_keys`` fetched at upload, in ``workdir / "images"`` with their
    index; None when they fetched none (data URLs only, or no images)."""
    index: dict[str, str] = {}
    folder = workdir / "images"
    for blob_key in blob_keys:
        for entry in read_manifest(blobs, blob_key):
            url, sha256 = entry["url"], entry["sha256"]
            if not url or url in index:
                continue
            if not (folder / sha256).exists():
                folder.mkdir(exist_ok=True)
                with (folder / sha256).open("wb") as fh:
                    blobs.copy_to(fetched_key(blob_key, sha256), fh)
            index[url] = sha256
    if not index:
        return None
    (folder / INDEX_FILE).write_text(json.dumps(index), encoding="utf-8")
    return folder
