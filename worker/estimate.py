"""The data half of a job's pre-flight estimate, on an inference worker (service/jobs/estimate_task.py):
the model's config, and for a supervised or preference-pair job the file's token statistics, through the
trainers' own tokenization (``trainers.data.file_stats``)."""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from service.config import get_settings
from service.inference.replies import reply_writer
from service.jobs.estimate_task import EstimateTask
from service.storage import get_blob_store
from trainers.core.errors import DataError
from trainers.data.jsonl_rows import JsonlRows
from trainers.modalities import image_token_id, takes_images
from trainers.registry import PREFERENCE_FORMATS, SUPERVISED_FORMATS, get_method
from worker.file_images import fetched_images
from worker.models import resolve_model_path
from worker.replies import RequestRefused, errors_replied

log = logging.getLogger("tunehouse.estimate")


def estimate_data(task: EstimateTask) -> dict[str, Any]:
    """`{"model_config": config.json, "data": statistics | None}`; ModelNotAvailable, DataError,
    BlobStoreUnavailable as the cases a client sees."""
    settings, blobs = get_settings(), get_blob_store()
    path = resolve_model_path(settings, blobs, tenant_id=task.tenant_id, name=task.model)
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    # the methods whose files the estimate tokenizes: the SFT formats and preference pairs (KTO's unpaired
    # rows and the RL methods' prompts count examples only, for now)
    formats = get_method(task.method_type).formats
    if formats not in (SUPERVISED_FORMATS, PREFERENCE_FORMATS) or task.max_length is None:
        return {"model_config": config, "data": None}
    from trainers.data.file_stats import pair_file_stats, sft_file_stats
    from trainers.data.vision import ImageFiles, VisionData
    from trainers.modeling.loading import load_tokenizer
    from trainers.modeling.vision import load_processor

    with tempfile.TemporaryDirectory(prefix="estimate-") as tmp:
        local = Path(tmp) / "training_file.jsonl"
        with local.open("wb") as fh:
            blobs.copy_to(task.training_blob_key, fh)
        lines = JsonlRows(local, param="training_file")
        vision = None
        if takes_images(config):  # its rows' images through its processor, as training reads them
            images_dir = fetched_images(blobs, [task.training_blob_key], workdir=Path(tmp))
            vision = VisionData(
                load_processor(path), ImageFiles(images_dir), image_token_id=image_token_id(config)
            )
        tokenizer = vision.tokenizer if vision is not None else load_tokenizer(path)
        stats = (
            sft_file_stats(
                lines,
                tokenizer,
                max_length=task.max_length,
                batch_size=task.batch_size,
                preview=task.preview,
                vision=vision,
            )
            if formats == SUPERVISED_FORMATS
            else pair_file_stats(
                lines,
                tokenizer,
                max_length=task.max_length,
                max_prompt_length=task.max_prompt_length,
                batch_size=task.batch_size,
                preview=task.preview,
                vision=vision,
            )
        )
    rows, width, targets = stats.largest_micro_batch()
    micro_batch = {
        "rows": rows,
        "width": width,
        "targets": targets,
        "image_tokens": stats.largest_micro_batch_images(),
    }
    data = {**stats.as_dict(), "micro_batch": micro_batch}
    return {"model_config": config, "data": data}


def serve_estimate(payload: dict[str, Any]) -> None:
    task = EstimateTask.model_validate(payload)
    if time.time() > task.deadline:
        log.info("estimate %s: dropped, its client stopped waiting", task.request_id)
        return
    replies = reply_writer(get_settings(), task.request_id)
    with errors_replied(
        replies,
        request_id=task.request_id,
        log=log,
        failed=f"The worker failed to estimate request {task.request_id}",
        code="estimate_failed",
    ):
        try:
            data = estimate_data(task)
        except DataError as exc:
            param = exc.param or "training_file"
            raise RequestRefused(f"{param}: {exc.message}", param=param) from exc
        replies.send({"type": "done", **data})
