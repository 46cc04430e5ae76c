"""Data parallelism for the shared loop: N ranks (processes) train one job as one.

Launch: ``python -m torch.distributed.run --standalone --nproc-per-node N ...`` (the worker does it,
worker/launch.py) sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and a rendezvous; ``init_from_env``
joins the process group: NCCL on CUDA (one device per local rank), gloo on CPU.

What one optimizer step is, with ``W`` ranks: ``gradient_accumulation_steps x W`` micro-batches of
``batch_size`` examples, taken in the epoch's order; rank ``r`` trains micro-batches ``r, r+W, ...`` of
them. Every rank divides its summed loss by the *global* number of loss units (an all-reduce before the
backward), and gradients are summed over ranks, so a step is the same arithmetic as one process running
``gradient_accumulation_steps x W`` micro-batches: the loss curve of W ranks equals that of one process
with the same global batch, up to float summation order.

Online methods (GRPO, PPO, RLOO, online DPO) split the step's prompts the same way: each rank samples,
scores and trains on its micro-batches' prompts, and takes the step's statistics (a batch-wide reward
std, PPO's advantage whitening, the reported metrics) over every rank's completions (``gather_rows``,
``sum_tensor``). An epoch's last step that has fewer micro-batches than ranks gives the ranks left over
micro-batches from the epoch's start, as accelerate's ``even_batches`` does: a rank with nothing to sample
would have nothing to score either. Sampling draws differ from one process's (each rank samples its own
batch, seeded by the step's seed plus its rank), so an online run's curve on W ranks is another sample
of the same process than the 1-rank curve, not the same numbers.

Strategies:

- ``ddp``: every rank holds the whole model and optimizer; gradients are summed with one all-reduce per
  step over a flat buffer (``torch._utils._flatten_dense_tensors``), the arithmetic of
  ``DistributedDataParallel``. We do not wrap the model in ``DistributedDataParallel`` because its
  forward-time hooks require every rank to run the same number of forwards, and an epoch's last step may
  leave a rank with no micro-batch (and the methods' loss functions call model methods the wrapper
  hides, e.g. peft's ``disable_adapter`` for the DPO reference). Weights and optimizer state stay equal
  on every rank, so rank 0's checkpoint is the whole state and resumes on any number of ranks.
- ``fsdp``: each rank holds a shard of the weights, gradients and optimizer state (torch's
  ``fully_shard``), for models whose training state does not fit one device: ``trainers.core.sharding``.

Only rank 0 reports (metrics, events, checkpoints); the stop decision (cancel, pause) is rank 0's and is
broadcast to every rank each step. A rank that dies makes the others fail in their next collective
(gloo: at once, the peer's socket closes; NCCL: within ``timeout``); ``CollectiveError`` says so and the
launcher tears the rest down, so no rank hangs.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

STRATEGIES = ("ddp", "fsdp")


class CollectiveError(RuntimeError):
    """A collective failed or timed out: another rank died or hung. The run cannot go on; the caller
    exits without recording an outcome, so the job restarts from its latest checkpoint."""


_strategy = "ddp"


def strategy() -> str:
    """How the ranks share the model: ``ddp`` (each holds it whole) or ``fsdp``
    (``trainers.core.sharding``)."""
    return _strategy


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def launched_ranks() -> int:
    """How many ranks the launcher started (``WORLD_SIZE``), 1 when not launched distributed."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` on a GPU host, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_from_env(*, timeout_seconds: float, strategy: str = "ddp") -> bool:
    """Join the process group the launcher set up; True if this call joined it (False for a single
    process, or a group joined before: Ray Train joins it before it calls the training function)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    global _strategy
    _strategy = strategy
    if launched_ranks() <= 1 or dist.is_initialized():
        return False
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=timeout_seconds),
    )
    return True


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def _collective(what: str) -> Iterator[None]:
    try:
        yield
    except (RuntimeError, dist.DistBackendError) as exc:  # gloo/NCCL: a peer closed, or a timeout
        raise CollectiveError(f"rank {rank()}: {what} failed; another rank died or hung: {exc}") from exc


def sum_floats(values: Sequence[float], device: torch.device) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (float64, so counts stay exact)."""
    if world_size() == 1:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    with _collective("all_reduce(sums)"):
        dist.all_reduce(t)
    return [float(x) for x in t.tolist()]


def sum_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """Sum every parameter's gradient over all ranks in place (a rank that ran no micro-batch sends
    zeros). One flat buffer per dtype: one collective instead of one per tensor. A parameter no rank
    has a gradient for keeps ``grad = None``, as in one process (AdamW then skips it: no decay)."""
    if world_size() == 1 or not params:
        return
    device = params[0].device
    anywhere = sum_floats([0.0 if p.grad is None else 1.0 for p in params], device)
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p, count in zip(params, anywhere, strict=True):
        if count == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group in by_dtype.values():
        grads = [p.grad for p in group if p.grad is not None]
        flat = _flatten_dense_tensors(grads)  # type: ignore[no-untyped-call]
        with _collective("all_reduce(gradients)"):
            dist.all_reduce(flat)
        summed_grads = _unflatten_dense_tensors(flat, grads)  # type: ignore[no-untyped-call]
        for grad, summed in zip(grads, summed_grads, strict=True):
            grad.copy_(summed)


def broadcast_code(code: int, device: torch.device) -> int:
    """Rank 0's ``code`` on every rank (the stop decision)."""
    if world_size() == 1:
        return code
    t = torch.tensor([code], dtype=torch.int64, device=device)
    with _collective("broadcast(stop)"):
        dist.broadcast(t, src=0)
    return int(t.item())


def barrier() -> None:
    """Wait until every rank is here."""
    if world_size() == 1:
        return
    with _collective("barrier"):
        dist.barrier()


def broadcast_parameters(params: Sequence[torch.nn.Parameter]) -> None:
    """Rank 0's values of ``params`` on every rank."""
    if world_size() == 1:
        return
    with _collective("broadcast(parameters)"), torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=0)


def gather_rows(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], slice]:
    """Every rank's rows of each tensor, concatenated in rank order (one collective for all of them),
    and where this rank's rows are in them. Ranks may hold different numbers of rows; the trailing
    dimensions must agree. The online methods take a step's statistics over these (reward std, advantage
    whitening, metrics), so that they are the step's, not one rank's share of it."""
    rows = tensors[0].size(0)
    if world_size() == 1:
        return list(tensors), slice(0, rows)
    parts = [p for p in gather_objects([t.detach().cpu() for t in tensors]) if isinstance(p, list)]
    start = sum(part[0].size(0) for part in parts[: rank()])
    joined = [torch.cat([part[i] for part in parts]).to(t.device) for i, t in enumerate(tensors)]
    return joined, slice(start, start + rows)


def sum_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over all ranks (a new tensor; ``t`` itself on one rank)."""
    if world_size() == 1:
        return t
    total = t.detach().to(device=_backend_device(), dtype=torch.float64, copy=True)
    with _collective("all_reduce(tensor)"):
        dist.all_reduce(total)
    return total.to(device=t.device, dtype=t.dtype)


def agree(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank: a decision that must be the same everywhere (a checkpoint is due,
    and every rank takes part in writing it), taken by rank 0 alone."""
    if world_size() == 1:
        return flag
    return bool(broadcast_code(int(flag), _backend_device()))


def gather_objects(obj: object) -> list[object]:
    """Every rank's ``obj`` (picklable), in rank order."""
    if world_size() == 1:
        return [obj]
    gathered: list[object] = [None] * world_size()
    with _collective("all_gather(objects)"):
        dist.all_gather_object(gathered, obj)
    return gathered


def _backend_device() -> torch.device:
    """Where collective tensors live: this rank's GPU under NCCL, else the CPU (gloo)."""
    return local_device() if dist.get_backend() == "nccl" else torch.device("cpu")


def union_keys(mapping: Mapping[str, object]) -> list[str]:
    """The sorted union of every rank's keys (ranks may have run different micro-batches)."""
    return sorted({key for keys in gather_objects(sorted(mapping)) if isinstance(keys, list) for key in keys})
