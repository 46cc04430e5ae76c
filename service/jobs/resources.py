"""What a job runs on: `resources: {"gpus": N, "strategy": "ddp" | "fsdp"}`, an extension field.

A job of N GPUs trains on N ranks of one worker host (trainers/core/distributed.py; launched by
worker/launch.py). Its run messages go to the queue of N-GPU jobs (`queue_for`), which only workers
with at least N GPUs consume (`queues_served`), so a job never lands on a host too small for it. The
global batch is `batch_size x gradient_accumulation_steps x gpus`: each rank trains its share of the
step's micro-batches, and the job object shows the product as `resources.global_batch_size`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# one job runs on one worker host: 64 is more GPUs than any host has
MAX_GPUS = 64
Strategy = Literal["ddp", "fsdp"]


class Resources(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    gpus: Annotated[int, Field(ge=1, le=MAX_GPUS)] = 1
    # ddp: each rank holds the whole model, gradients are summed; fsdp: weights, gradients and optimizer
    # state sharded over the ranks (trainers/core/sharding.py)
    strategy: Strategy = "ddp"


ONE_GPU = Resources()


def job_resources(stored: dict[str, Any] | None) -> Resources:
    """A job row's resources (rows from before the field: one GPU)."""
    return Resources.model_validate(stored) if stored else ONE_GPU


def queue_for(base_queue: str, gpus: int) -> str:
    """The queue of the jobs that need `gpus` GPUs: the pool's own queue for one GPU, so one-GPU
    deployments and their workers see no change."""
    return base_queue if gpus == 1 else f"{base_queue}.gpus{gpus}"


def queues_served(base_queue: str, gpus: int) -> list[str]:
    """The queues a worker with `gpus` GPUs consumes: every job size it can hold."""
    return [queue_for(base_queue, n) for n in range(1, max(1, gpus) + 1)]


def global_batch_size(hyperparameters: dict[str, Any], gpus: int) -> int | None:
    """Examples per optimizer step over all ranks (None when the batch is not a number)."""
    batch, accumulation = (
        hyperparameters.get("batch_size"),
        hyperparameters.get("gradient_accumulation_steps", 1),
    )
    if not isinstance(batch, int) or not isinstance(accumulation, int):
        return None
    return batch * accumulation * gpus
