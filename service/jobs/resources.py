"""What a job runs on: `resources: {"nodes": N, "gpus_per_node": G, "strategy": "ddp" | "fsdp"}`, an
extension field (`gpus` is the one-node name of `gpus_per_node`, kept from before `nodes` existed).

A one-node job of G GPUs trains on G ranks of one worker host (trainers/core/distributed.py; launched by
worker/launch.py). Its run messages go to the queue of G-GPU jobs (`queue_for`), which only workers
with at least G GPUs consume (`queues_served`), so a job never lands on a host too small for it.

A job of N > 1 nodes runs on the operator's Ray cluster (`TUNEHOUSE_RAY_ADDRESS`): its messages go to
the pool's Ray queue, which only workers pointed at a Ray cluster consume, and the worker that claims
it drives N x G ranks spread over N nodes through Ray Train (worker/ray_driver.py).

The global batch is `batch_size x gradient_accumulation_steps x nodes x gpus_per_node`: each rank trains
its share of the step's micro-batches, and the job object shows the product as
`resources.global_batch_size`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# one node is one worker host: 64 is more GPUs than any host has
MAX_GPUS = 64
# a bound on the field itself; the operator's maximum (settings.max_nodes) is checked at creation
MAX_NODES = 1024
Strategy = Literal["ddp", "fsdp"]


class Resources(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    nodes: Annotated[int, Field(ge=1, le=MAX_NODES)] = 1
    gpus_per_node: Annotated[int, Field(ge=1, le=MAX_GPUS)] | None = None
    # the one-node spelling of gpus_per_node (a request gives one of the two)
    gpus: Annotated[int, Field(ge=1, le=MAX_GPUS)] | None = None
    # ddp: each rank holds the whole model, gradients are summed; fsdp: weights, gradients and optimizer
    # state sharded over the ranks (trainers/core/sharding.py)
    strategy: Strategy = "ddp"

    @property
    def per_node(self) -> int:
        """Ranks (GPUs) on each node."""
        return self.gpus_per_node or self.gpus or 1

    @property
    def ranks(self) -> int:
        """Ranks of the whole job: the world size."""
        return self.nodes * self.per_node

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    def stored(self) -> dict[str, Any]:
        """The row's form: one spelling of the GPUs per node."""
        return {"nodes": self.nodes, "gpus_per_node": self.per_node, "strategy": self.strategy}

    def shown(self) -> dict[str, Any]:
        """The job object's form: `gpus` is every rank of the job (as before `nodes` existed)."""
        return {**self.stored(), "gpus": self.ranks}


ONE_GPU = Resources()


def job_resources(stored: dict[str, Any] | None) -> Resources:
    """A job row's resources (rows from before the field: one GPU; before `nodes`: `{"gpus": G}`)."""
    return Resources.model_validate(stored) if stored else ONE_GPU


def queue_for(base_queue: str, resources: Resources) -> str:
    """The queue of the jobs that need `resources`: the pool's own queue for one GPU, so one-GPU
    deployments and their workers see no change; the Ray queue for several nodes."""
    if resources.multi_node:
        return ray_queue(base_queue)
    return gpus_queue(base_queue, resources.per_node)


def gpus_queue(base_queue: str, gpus: int) -> str:
    return base_queue if gpus == 1 else f"{base_queue}.gpus{gpus}"


def ray_queue(base_queue: str) -> str:
    """The queue of multi-node jobs: consumed by the workers that can reach the Ray cluster."""
    return f"{base_queue}.ray"


def queues_served(base_queue: str, gpus: int, *, ray: bool = False) -> list[str]:
    """The queues a worker with `gpus` GPUs consumes: every job size it can hold, and the multi-node
    jobs when it is pointed at a Ray cluster."""
    own = [gpus_queue(base_queue, n) for n in range(1, max(1, gpus) + 1)]
    return [*own, ray_queue(base_queue)] if ray else own


def global_batch_size(hyperparameters: dict[str, Any], ranks: int) -> int | None:
    """Examples per optimizer step over all ranks (None when the batch is not a number)."""
    batch, accumulation = (
        hyperparameters.get("batch_size"),
        hyperparameters.get("gradient_accumulation_steps", 1),
    )
    if not isinstance(batch, int) or not isinstance(accumulation, int):
        return None
    return batch * accumulation * ranks
