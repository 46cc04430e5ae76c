"""A job's pre-flight estimate (POST /v1/fine_tuning/jobs/estimate): what the job would train on, its
steps, its peak memory on each kind of live training worker and whether it fits, how long it would take
and where it would queue, before anything is created.

The body is checked by the creation's own `check_spec` (a 400 names the field, as creation's would).
Nothing is stored and no run message is sent: the only message is the data half of the estimate, sent
to an inference worker (service/jobs/estimate_task.py says why a worker). The memory model is
`trainers.memory_model` (torch-free); the fleet is the `workers` table; the throughput is the
`tokens_per_second` of the metric rows of earlier succeeded jobs on the same model and method (every
tenant's: a fleet figure, no tenant's data).
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

import anyio
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.inference.replies import Message, ReplyChannelDown, reply_reader
from service.inference.service import channel_down, first_answer
from service.jobs import repository
from service.jobs.creation import CheckedSpec, check_spec
from service.jobs.estimate_schemas import (
    DeviceFit,
    EstimateObject,
    ImageCounts,
    MemoryBreakdown,
    PreviewSpan,
    TrainedTokens,
    Truncation,
    WallTime,
    WorkerKind,
)
from service.jobs.estimate_task import ESTIMATE_TASK, EstimateTask
from service.jobs.fairness import position_if_queued_now
from service.jobs.resources import queue_for
from service.jobs.spec import JobCreate
from service.models import Tenant, Worker
from trainers.memory_model import (
    Device,
    ModelShape,
    TrainingShape,
    estimate_memory,
    planned_steps,
    precision_bytes,
)
from trainers.registry import get_method

PREVIEW_EXAMPLES = 3
# the metric rows read for a throughput: the latest of the latest finished jobs
THROUGHPUT_JOBS, THROUGHPUT_ROWS = 20, 2000
# sequences a step runs per example: a preference pair is two, KTO pairs each completion with a mismatched
# one for its KL reference point
_ROWS_PER_EXAMPLE = {"dpo": 2, "reward_model": 2, "orpo": 2, "cpo": 2, "simpo": 2, "kto": 2}


async def _worker_data(settings: Settings, task: EstimateTask) -> Message:
    """The worker's answer to `task` (its `done` message); AppError for every way it cannot come."""
    reader = reply_reader(settings, task.request_id)
    try:
        return await first_answer(
            settings,
            reader,
            task=ESTIMATE_TASK,
            payload=task.model_dump(mode="json"),
            why=" The estimate reads the training file with the model's tokenizer there.",
        )
    except ReplyChannelDown as exc:
        raise channel_down(exc) from exc
    finally:
        await reader.close()


def _worker_kinds(session: Session, settings: Settings) -> list[WorkerKind]:
    cutoff = time.time() - settings.lease_timeout_seconds
    rows = session.execute(
        select(Worker.device, Worker.device_name, Worker.device_memory_bytes, Worker.gpus, func.count())
        .where(Worker.queue == settings.job_queue, Worker.seen_at >= cutoff)
        .group_by(Worker.device, Worker.device_name, Worker.device_memory_bytes, Worker.gpus)
        .order_by(Worker.device, Worker.device_memory_bytes, Worker.gpus)
    ).all()
    return [
        WorkerKind(device=d, device_name=n, device_memory_bytes=m, gpus=g, workers=c)
        for d, n, m, g, c in rows
    ]


def _fit(
    kind: WorkerKind,
    model: ModelShape,
    checked: CheckedSpec,
    hp: dict[str, Any],
    batch: tuple[int, int, int],
    image_tokens: int = 0,
) -> DeviceFit:
    device: Device = "cuda" if kind.device == "cuda" else "cpu"
    compute, lora_base = precision_bytes(str(hp.get("mixed_precision", "auto")), device)
    rows, width, targets = batch
    shape = TrainingShape(
        lora=bool(hp.get("lora", True)),
        lora_r=int(hp.get("lora_r", 8)),
        lora_target_modules=tuple(hp["lora_target_modules"]) if hp.get("lora_target_modules") else None,
        weight_bytes=lora_base,
        compute_bytes=compute,
        micro_batch_rows=rows,
        row_width=width,
        micro_batch_targets=targets,
        gradient_checkpointing=bool(hp.get("gradient_checkpointing", False)),
        reference=get_method(checked.method.type).uses_reference(hp),
        ranks=checked.resources.ranks,
        sharded=checked.resources.strategy == "fsdp" and checked.resources.ranks > 1,
        # flash attention's varlen kernel (no mask) runs on CUDA in half precision
        varlen_attention=device == "cuda" and compute == 2,
        padded=rows > 1,  # a lone row needs no attention mask
        device=device,
        image_tokens=image_tokens,
        train_vision_tower=bool(hp.get("train_vision_tower", False)),
        train_projector=bool(hp.get("train_projector", False)),
    )
    breakdown = estimate_memory(model, shape).as_dict()
    fits: bool | None = None
    reason = None
    if kind.gpus < checked.resources.per_node:
        fits, reason = (
            False,
            f"the job needs {checked.resources.per_node} devices a node, these workers have {kind.gpus}",
        )
    elif kind.device_memory_bytes is not None:
        fits = breakdown["total"] <= kind.device_memory_bytes
        if not fits:
            reason = (
                f"{breakdown['total'] / 2**30:.2f} GiB at peak per device, "
                f"{kind.device_memory_bytes / 2**30:.2f} GiB on each"
            )
    return DeviceFit(
        worker_kind=kind, peak_memory_bytes=MemoryBreakdown(**breakdown), fits=fits, reason=reason
    )


def _verdict(
    fits: list[DeviceFit], hp: dict[str, Any], data: dict[str, Any] | None, tokens: TrainedTokens | None
) -> tuple[bool | None, str | None]:
    """Whether the job can run as asked, and why not: a run that trains no token is refused first (it
    would "succeed" having learnt nothing), then one no live worker can hold."""
    if data is not None and (int(data["trained_examples"]) == 0 or (tokens and tokens.loss_per_epoch == 0)):
        dropped = data["dropped_lines"]
        cut = (
            f" (lines {', '.join(map(str, dropped[:5]))}{', ...' if len(dropped) > 5 else ''})"
            if dropped
            else ""
        )
        return False, (
            f"the job would train nothing: no example keeps a token to train on at max_length "
            f"{hp.get('max_length')}{cut}; raise max_length or check the assistant turns' weights"
        )
    if not fits:
        return None, "no training worker is live: its memory is unknown"
    if any(f.fits for f in fits):
        return True, None
    if all(f.fits is False for f in fits):
        return False, "no live worker can hold it: " + "; ".join(str(f.reason) for f in fits)
    return None, "the memory of the live workers is unknown"


def _micro_batch(method: str, hp: dict[str, Any], data: dict[str, Any] | None) -> tuple[int, int, int]:
    """(rows, padded width, trained tokens) of the largest micro-batch: measured from the file where the
    worker tokenized it, else the bound the hyperparameters set."""
    if data is not None:
        mb = data["micro_batch"]
        return int(mb["rows"]), int(mb["width"]), int(mb["targets"])
    batch = int(hp["batch_size"])
    if "num_generations" in hp:  # RL: every prompt's completions, prompt + completion wide
        rows = batch * int(hp["num_generations"])
        width = int(hp.get("max_prompt_length") or 0) + int(hp.get("max_completion_length") or 0)
        return rows, width, rows * int(hp.get("max_completion_length") or 1)
    rows = batch * _ROWS_PER_EXAMPLE.get(method, 1)
    width = int(hp.get("max_length") or 1024)
    return rows, width, rows * width


def _wall_time(session: Session, *, model: str, method: str, trained_tokens: int | None) -> WallTime:
    if trained_tokens is None:
        return WallTime(seconds=None, reason="the trained tokens are not counted for this method yet")
    rows = repository.latest_metrics_of_succeeded(
        session, model=model, method=method, jobs=THROUGHPUT_JOBS, rows=THROUGHPUT_ROWS
    )
    rates = [float(v["tokens_per_second"]) for _, v in rows if (v or {}).get("tokens_per_second")]
    if not rates:
        return WallTime(
            seconds=None,
            reason=f"no succeeded job on '{model}' with method '{method}' has reported its throughput yet",
        )
    rate = statistics.median(rates)
    n_jobs = len({job_id for job_id, v in rows if (v or {}).get("tokens_per_second")})
    return WallTime(
        seconds=round(trained_tokens / rate, 1),
        reason=f"the median trained tokens per second of {n_jobs} earlier jobs on this model and method",
        tokens_per_second=round(rate, 1),
        measured_jobs=n_jobs,
    )


def estimate_job(session: Session, *, tenant: Tenant, spec: JobCreate, settings: Settings) -> EstimateObject:
    """The estimate of `spec` (module docstring). Runs on a worker thread of the API (a sync route): the
    wait for the worker's answer runs on the event loop through `anyio.from_thread`."""
    checked = check_spec(session, tenant=tenant, spec=spec, settings=settings)
    method = checked.method.type
    hp = checked.method.hyperparameters.model_dump()
    task = EstimateTask(
        request_id=f"est-{uuid.uuid4().hex}",
        tenant_id=tenant.id,
        model=spec.model,
        method_type=method,
        training_blob_key=checked.training.blob_key,
        max_length=hp.get("max_length"),
        max_prompt_length=hp.get("max_prompt_length"),
        batch_size=int(hp["batch_size"]),
        preview=PREVIEW_EXAMPLES,
        deadline=time.time() + settings.inference_timeout_seconds,
    )
    answer = anyio.from_thread.run(_worker_data, settings, task)
    data: dict[str, Any] | None = answer.get("data")
    model = ModelShape.from_config(answer["model_config"])
    examples = int(data["examples"]) if data else checked.training.line_count
    trained_examples = int(data["trained_examples"]) if data else None
    epochs = int(hp["n_epochs"])
    steps = planned_steps(
        examples=trained_examples if trained_examples is not None else examples,
        batch_size=int(hp["batch_size"]),
        accumulation=int(hp.get("gradient_accumulation_steps", 1)),
        ranks=checked.resources.ranks,
        epochs=epochs,
        max_steps=hp.get("max_steps"),
    ) * int(hp.get("num_iterations", 1))
    tokens = None
    if data:
        per_epoch = int(data["tokens_per_epoch"])
        total = per_epoch * epochs
        if hp.get("max_steps") is not None:  # a capped run trains its share of the epochs' tokens
            full = planned_steps(
                examples=trained_examples or 1,
                batch_size=int(hp["batch_size"]),
                accumulation=int(hp.get("gradient_accumulation_steps", 1)),
                ranks=checked.resources.ranks,
                epochs=epochs,
                max_steps=None,
            )
            total = round(total * steps / max(full, 1))
        tokens = TrainedTokens(
            per_epoch=per_epoch, total=total, loss_per_epoch=int(data["loss_tokens_per_epoch"])
        )
    batch = _micro_batch(method, hp, data)
    image_tokens = int(data["micro_batch"].get("image_tokens", 0)) if data else 0
    queue = queue_for(settings.job_queue, checked.resources)
    fits = [_fit(k, model, checked, hp, batch, image_tokens) for k in _worker_kinds(session, settings)]
    verdict, why = _verdict(fits, hp, data, tokens)
    return EstimateObject(
        fits=verdict,
        reason=why,
        model=spec.model,
        method=method,
        examples=examples,
        trained_examples=trained_examples,
        trained_tokens=tokens,
        tokens_reason=None
        if data
        else f"token counts are computed for supervised and preference-pair jobs, not '{method}'",
        total_steps=steps,
        truncated=Truncation(
            count=data["truncated"], first_lines=data["truncated_lines"], dropped_lines=data["dropped_lines"]
        )
        if data
        else None,
        images=ImageCounts(
            per_epoch=int(data["images_per_epoch"]), tokens_per_epoch=int(data["image_tokens_per_epoch"])
        )
        if data and data.get("images_per_epoch")
        else None,
        peak_memory_bytes=fits,
        estimated_wall_time=_wall_time(
            session, model=spec.model, method=method, trained_tokens=tokens.total if tokens else None
        ),
        queue_position=position_if_queued_now(session, tenant_id=tenant.id, queue=queue, now=time.time()),
        preview=[[PreviewSpan(**s) for s in example] for example in (data["preview"] if data else [])],
    )
