"""The training loop every method shares: batches -> loss -> AdamW step, with callbacks and checkpoints.

A method (SFT, DPO, ...) hands the loop a ``TrainingTask``: the model, its examples, a collate function
and a loss function returning *sums* over the batch's loss units (target tokens for SFT). An optimizer
step accumulates ``gradient_accumulation_steps`` micro-batches of ``batch_size`` examples and divides
every summed loss by the number of loss units in the whole accumulated batch, so

    loss = sum of per-unit losses in the step / number of units in the step,

whatever the padding, packing or accumulation. Gradients are clipped to ``max_grad_norm`` (the norm is
reported before clipping), then AdamW steps, then the learning-rate schedule advances.

Examples are visited in a fresh permutation per epoch drawn from ``(seed, epoch)``; an epoch's last step
may have fewer micro-batches. The step, data position, optimizer, scheduler and RNG states are
checkpointed, so a resumed run repeats the uninterrupted run's losses exactly.

Online methods (GRPO, PPO, RLOO, online DPO) add a ``StepPreparer`` to the task: the loop hands it each
step's examples (prompts) and the model, and trains on the batches it returns (rollouts). A preparer may
train on one group of examples for several consecutive optimizer steps (GRPO's ``num_iterations``, PPO's
epochs over mini-batches); its state (the rollout in use) and an ``extra_trainable`` module (PPO's value
head) are checkpointed with the rest, so online runs resume exactly too. Their validation is the task's
``evaluate`` pass (sample the validation prompts, grade them) instead of a loss on collated batches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, Protocol, Self, TypeVar

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase
from transformers.processing_utils import ProcessorMixin

from trainers.core import distributed as dist
from trainers.core import sharding, turns
from trainers.core.callbacks import CheckpointInfo, NullCallbacks, StopRequest, TrainingCallbacks, TrainResult
from trainers.core.checkpoint import (
    LoopState,
    load_loop_state,
    load_task_state,
    prune_checkpoints,
    restore_training_state,
    save_checkpoint,
)
from trainers.core.precision import autocast_dtype, computing_in
from trainers.core.schedule import build_scheduler

__all__ = [
    "Batch",
    "CheckpointInfo",
    "LoopSettings",
    "LossSums",
    "NullCallbacks",
    "PreparedStep",
    "StepPreparer",
    "StopRequest",
    "TrainResult",
    "TrainingCallbacks",
    "TrainingTask",
    "run_training",
]


class LoopSettings(Protocol):
    """The optimisation fields every method config has (see ``trainers.core.config.TrainingConfig``)."""

    output_dir: str
    n_epochs: int
    batch_size: int
    gradient_accumulation_steps: int
    learning_rate: float
    lr_scheduler: str
    warmup_ratio: float
    weight_decay: float
    max_grad_norm: float
    mixed_precision: str
    seed: int
    max_steps: int | None
    save_steps: int
    save_minutes: float
    keep_checkpoints: int
    eval_steps: int
    resume_from: str | None


class Batch(Protocol):
    @property
    def loss_denominator(self) -> int:
        """Loss units in this micro-batch (target tokens for SFT)."""

    @property
    def n_tokens(self) -> int:
        """Real input tokens, for throughput."""

    def to(self, device: torch.device) -> Self: ...


@dataclass(frozen=True)
class LossSums:
    """A micro-batch's summed loss and metrics.

    ``metrics`` are sums over the micro-batch's loss units, reported divided by the step's units, except
    those named in ``metric_units``: each of these is reported divided by the sum of its own units over
    the step (KTO's rewards of desirable examples, averaged over the desirable examples only) and left
    out of a row where those sum to 0.
    """

    loss: torch.Tensor  # scalar, summed over the micro-batch's loss units
    metrics: Mapping[
        str, float | torch.Tensor
    ]  # tensors (scalars) are read once per step, not per micro-batch
    metric_units: dict[str, float] = field(default_factory=dict)


E = TypeVar("E")
B = TypeVar("B", bound=Batch)


@dataclass(frozen=True)
class PreparedStep(Generic[B]):
    batches: list[B]  # the micro-batches of one optimizer step
    metrics: dict[str, float]  # reported as they are in the step row (rewards, completion lengths, ...)


class StepPreparer(Protocol[E, B]):
    """Builds each optimizer step's batches with the model being trained (rollouts, for RL methods).

    ``prepare`` gets the step's examples, one sequence per data micro-batch, and ``repeat``: the same
    examples are trained on for ``steps_per_rollout`` consecutive optimizer steps, with ``repeat`` going
    0, 1, ..., ``steps_per_rollout - 1`` (typically: generate at 0, reuse the rollout after). Called in
    train mode under the loop's autocast; ``state_dict`` must hold what a resumed run needs to carry on
    mid-rollout, as tensors and plain Python values.
    """

    @property
    def steps_per_rollout(self) -> int: ...

    def prepare(
        self, model: torch.nn.Module, examples: list[Sequence[E]], repeat: int
    ) -> PreparedStep[B]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainingTask(Generic[E, B]):
    """What a method gives the loop.

    ``collate`` batches ``train_data`` (and ``valid_data``) unless a ``preparer`` builds the training
    batches. ``extra_trainable``: a module trained with ``model`` (same optimizer) that is saved in
    resumable checkpoints but never exported (PPO's value head). ``evaluate``: a validation pass of its
    own that replaces the loss on ``valid_data`` (the online methods sample and grade the validation
    prompts, ``trainers.families.rl.reward_evaluator``); it gets the model and returns the eval row's
    ``valid_*``
    metrics, and must leave the global RNG as it found it (resumed runs stay exact).
    """

    model: torch.nn.Module
    tokenizer: (
        PreTrainedTokenizerBase | ProcessorMixin
    )  # saved beside the weights; a vision model's processor
    train_data: Sequence[E]
    collate: Callable[[Sequence[E]], B]
    loss_fn: Callable[[torch.nn.Module, B], LossSums]
    valid_data: Sequence[E] | None = None
    preparer: StepPreparer[E, B] | None = None
    extra_trainable: torch.nn.Module | None = None
    evaluate: Callable[[torch.nn.Module], dict[str, float]] | None = None


# the clock of `save_minutes`: training time, immune to wall-clock jumps (tests swap it for a fake one)
clock: Callable[[], float] = time.monotonic


def epoch_permutation(seed: int, epoch: int, n: int) -> list[int]:
    return [int(i) for i in np.random.default_rng([seed, epoch]).permutation(n)]


def run_training(
    settings: LoopSettings, task: TrainingTask[E, B], callbacks: TrainingCallbacks | None = None
) -> TrainResult:
    return _Loop(settings, task, callbacks or NullCallbacks()).run()


class _Loop(Generic[E, B]):
    def __init__(
        self, settings: LoopSettings, task: TrainingTask[E, B], callbacks: TrainingCallbacks
    ) -> None:
        # rank 0 alone reports; every rank trains its share of each step (trainers/core/distributed.py)
        self.world, self.rank = dist.world_size(), dist.rank()
        self.s, self.task = settings, task
        self.cb: TrainingCallbacks = callbacks if self.rank == 0 else NullCallbacks()
        self.model = task.model
        self.device = next(self.model.parameters()).device
        self.sharded = self.world > 1 and dist.strategy() == "fsdp"
        if self.sharded:  # before the optimizer sees the parameters
            sharding.shard_model(self.model, self.device)
            if task.extra_trainable is not None:
                sharding.shard_model(task.extra_trainable, self.device)
        self.compute_dtype = autocast_dtype(settings.mixed_precision, self.device)
        n = len(task.train_data)
        self.micro_per_epoch = math.ceil(n / settings.batch_size)
        self.repeats = task.preparer.steps_per_rollout if task.preparer is not None else 1
        # micro-batches per optimizer step, over all ranks: the global batch is
        # batch_size x gradient_accumulation_steps x world size
        self.group = settings.gradient_accumulation_steps * self.world
        self.groups_per_epoch = math.ceil(self.micro_per_epoch / self.group)
        self.steps_per_epoch = self.groups_per_epoch * self.repeats
        resumed = load_loop_state(settings.resume_from) if settings.resume_from else LoopState()
        self.total_steps = self._total_steps(resumed)
        modules = [self.model] if task.extra_trainable is None else [self.model, task.extra_trainable]
        self.params = [p for m in modules for p in m.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            _param_groups(self.params, settings.weight_decay),
            lr=settings.learning_rate,
            # one fused kernel over all parameters: ~4x faster than the per-tensor loop on CPU (see
            # git log -p docs/benchmarks.md), and what transformers' Trainer uses by default
            fused=_fusable(self.params) or None,
        )
        self.scheduler = build_scheduler(
            self.optimizer,
            kind=settings.lr_scheduler,
            warmup_steps=math.ceil(settings.warmup_ratio * self.total_steps),
            total_steps=self.total_steps,
        )
        fp16 = self.compute_dtype == torch.float16
        self.scaler = torch.amp.GradScaler(self.device.type) if fp16 else None
        self.state = LoopState(total_steps=self.total_steps, sampler_seed=settings.seed)
        self.last_ckpt: CheckpointInfo | None = None
        self.saved: tuple[int, bool] | None = None  # (step, final) of the last checkpoint, on every rank
        self.saved_at = clock()  # for save_minutes: training time since the last checkpoint

    def _total_steps(self, at: LoopState) -> int:
        """Steps done at ``at`` plus the steps left from its data position. A checkpoint written with
        another world size resumes at the same example: its remaining micro-batches are grouped by this
        run's step size, and the learning-rate schedule is laid over the new total."""
        left_in_epoch = math.ceil((self.micro_per_epoch - at.batch_index) / self.group) * self.repeats
        later_epochs = max(0, self.s.n_epochs - at.epoch - 1) * self.steps_per_epoch
        total = at.step + max(0, left_in_epoch - at.repeat + later_epochs)
        return min(total, self.s.max_steps) if self.s.max_steps is not None else total

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        result = self._run()
        # the ranks leave together: rank 0 is still writing the final checkpoint when the others are
        # done, and a rank that tears its process group down under a working peer can abort (gloo)
        dist.barrier()
        return result

    def _run(self) -> TrainResult:
        if self.s.resume_from:
            self.state = restore_training_state(
                self.s.resume_from,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                scaler=self.scaler,
                reshard=partial(sharding.shard_optimizer_state, self.optimizer) if self.sharded else None,
            )
            self.state.total_steps = self.total_steps
            if len(self.state.permutation) != len(self.task.train_data):
                raise ValueError(f"{self.s.resume_from}: the training data changed since this checkpoint")
            self._load_task_state(load_task_state(self.s.resume_from))
        else:
            self.state.permutation = epoch_permutation(self.s.seed, 0, len(self.task.train_data))
        # same seed, same weights on every rank; broadcasting rank 0's makes sure, as DDP does (FSDP
        # cut each rank's shard from the same whole weights)
        if not self.sharded:
            dist.broadcast_parameters(self.params)
        self.cb.on_train_begin(total_steps=self.total_steps, n_epochs=self.s.n_epochs)
        self.saved_at = clock()
        self.model.train()
        if self.task.extra_trainable is not None:
            self.task.extra_trainable.train()
        while self.state.step < self.total_steps:
            stop = self._stop_request()
            if stop == StopRequest.CANCEL:  # `==`: a plain "cancel" string works too
                return TrainResult(None, StopRequest.CANCEL, self.state.step, dict(self.state.metrics))
            if stop == StopRequest.PAUSE:
                ckpt = self._checkpoint_once(final=False)
                return TrainResult(ckpt, StopRequest.PAUSE, self.state.step, dict(self.state.metrics))
            epoch_done = self._train_step()
            if self._eval_due(epoch_done):
                self._evaluate()
            if epoch_done:
                self.cb.on_epoch_end(epoch=self.state.epoch, step=self.state.step)
            # rank 0's clock decides (save_minutes): every rank takes part in writing the checkpoint
            if dist.agree(self._save_due()):
                self._checkpoint_once(final=False)
            turns.between_steps()  # other jobs on a shared base model step now (trainers/core/turns.py)
        final = self._checkpoint_once(final=True)
        return TrainResult(final, None, self.state.step, dict(self.state.metrics))

    def _stop_request(self) -> StopRequest | None:
        """Rank 0 asks its callbacks; every rank gets the answer, so cancel and pause reach them all."""
        codes = (None, StopRequest.CANCEL, StopRequest.PAUSE)
        mine = self.cb.should_stop() if self.rank == 0 else None
        code = codes.index(StopRequest(mine) if mine is not None else None)
        return codes[dist.broadcast_code(code, self.device)]

    def _train_step(self) -> bool:
        """One optimizer step; returns whether it finished an epoch."""
        s, st = self.s, self.state
        first = st.batch_index
        last = min(first + self.group, self.micro_per_epoch)
        start = time.perf_counter()
        step_metrics: dict[str, float] = {}
        stand_ins: list[B] = []
        # this rank's share of the step's micro-batches: every world-th one
        mine = list(range(first + self.rank, last, self.world))
        if self.task.preparer is None:
            batches = [self._micro_batch(st.permutation, i) for i in mine]
            if self.sharded:  # every forward gathers weights: every rank runs as many (stand-ins: 0)
                most = len(range(first, last, self.world))
                stand_ins = [self._micro_batch(st.permutation, first)] * (most - len(batches))
        else:
            # a rank left without prompts at an epoch's end samples some from its start instead (as
            # accelerate's even_batches): the step's statistics gather every rank's rollout
            mine = mine or [(first + self.rank) % self.micro_per_epoch]
            examples: list[Sequence[E]] = [self._micro_examples(st.permutation, i) for i in mine]
            with self._autocast(), self._gathered():
                prepared = self.task.preparer.prepare(self.model, examples, st.repeat)
            batches, step_metrics = prepared.batches, prepared.metrics
            if self.sharded:  # as many forwards as the rank with the most batches (stand-ins: 0)
                most = max(n for n in dist.gather_objects(len(batches)) if isinstance(n, int))
                if not batches:
                    raise ValueError(
                        "a rank got no batch of this step's rollout (fewer rows than mini-batches); "
                        "FSDP needs one on every rank: use ddp, or more prompts per step"
                    )
                stand_ins = [batches[0]] * (most - len(batches))
        # the whole step's loss units, over all ranks: each rank's share of the mean
        local_units = sum(b.loss_denominator for b in batches)
        denominator = max(1, round(dist.sum_floats([local_units], self.device)[0]))
        # summed on the device and read once per step: no host sync per micro-batch
        loss_total, metric_sums = torch.zeros((), device=self.device), _MetricSums()
        scale = float(self.world) if self.sharded else 1.0  # FSDP averages gradients; the loop sums
        for batch in batches:
            out = self._forward(batch.to(self.device))
            self._backward(out.loss * (scale / denominator))
            loss_total += out.loss.detach().float()
            metric_sums.add(out)
        for batch in stand_ins:
            self._backward(self._forward(batch.to(self.device)).loss * 0.0)
        if not self.sharded:  # FSDP's backward reduce-scatters the gradients itself
            dist.sum_gradients(self.params)
        local_tokens = sum(b.n_tokens for b in batches)
        loss_sum, n_tokens = metric_sums.reduce([float(loss_total), local_tokens], self.device)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        max_norm = s.max_grad_norm if s.max_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        learning_rate = float(self.scheduler.get_last_lr()[0])
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start

        st.step += 1
        st.repeat += 1
        if st.repeat == self.repeats:
            st.repeat = 0
            st.batch_index = last
        st.trained_tokens += round(n_tokens)
        epoch = self._epoch_progress()
        row = {
            "step": float(st.step),
            "epoch": epoch,
            "loss": loss_sum / denominator,
            "learning_rate": learning_rate,
            "grad_norm": grad_norm,
            "tokens_per_second": n_tokens / elapsed if elapsed > 0 else 0.0,
            **metric_sums.means(denominator),
            **step_metrics,
            "trained_tokens": float(st.trained_tokens),
            "total_steps": float(self.total_steps),
        }
        st.metrics = {**st.metrics, **row}
        self.cb.on_step(row)
        epoch_done = st.batch_index >= self.micro_per_epoch
        if epoch_done:
            st.epoch += 1
            st.batch_index = 0
            st.permutation = epoch_permutation(st.sampler_seed, st.epoch, len(self.task.train_data))
        return epoch_done

    def _micro_examples(self, order: Sequence[int], index: int) -> list[E]:
        size = self.s.batch_size
        return [self.task.train_data[i] for i in order[index * size : (index + 1) * size]]

    def _micro_batch(self, order: Sequence[int], index: int) -> B:
        return self.task.collate(self._micro_examples(order, index))

    def _epoch_progress(self) -> float:
        """Epochs done, fractional; a step that reuses a rollout counts for its share of the examples."""
        st = self.state
        group = min(self.s.gradient_accumulation_steps, self.micro_per_epoch - st.batch_index)
        return st.epoch + (st.batch_index + group * st.repeat / self.repeats) / self.micro_per_epoch

    def _gathered(self) -> AbstractContextManager[None]:
        """Whole weights for what runs a different number of forwards on each rank (sampling)."""
        if not self.sharded:
            return nullcontext()
        modules = [self.model, *([self.task.extra_trainable] if self.task.extra_trainable else [])]
        return sharding.gathered(modules)

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()  # type: ignore[no-untyped-call]

    def _autocast(self) -> AbstractContextManager[None]:
        return computing_in(self.model, self.compute_dtype, self.device)

    def _forward(self, batch: B) -> LossSums:
        with self._autocast():
            return self.task.loss_fn(self.model, batch)

    # -- evaluation -----------------------------------------------------------------------------------
    def _eval_due(self, epoch_done: bool) -> bool:
        if not self.task.valid_data and self.task.evaluate is None:
            return False
        if self.state.step == self.total_steps:
            return True
        if self.s.eval_steps > 0:
            return self.state.step % self.s.eval_steps == 0
        return epoch_done

    @torch.no_grad()
    def _evaluate(self) -> None:
        if self.task.evaluate is not None:
            with self._autocast(), self._gathered():
                metrics = self.task.evaluate(self.model)
        else:
            metrics = self._validation_loss()
        st = self.state
        row = {"step": float(st.step), "epoch": self._epoch_progress(), **metrics}
        st.metrics = {**st.metrics, **{k: v for k, v in row.items() if k.startswith("valid_")}}
        self.cb.on_eval(row)

    def _validation_loss(self) -> dict[str, float]:
        data = self.task.valid_data or []
        self.model.eval()
        loss_sum, units, metric_sums = 0.0, 0, _MetricSums()
        chunks = list(_chunks(data, self.s.batch_size))
        for index, batch in enumerate(chunks):
            if index % self.world != self.rank:  # each rank evaluates its share of the chunks
                continue
            collated = self.task.collate(batch)
            out = self._forward(collated.to(self.device))
            loss_sum += float(out.loss.item())
            units += collated.loss_denominator
            metric_sums.add(out)
        if self.sharded:  # a forward gathers weights: run as many as rank 0 does (stand-ins)
            missing = len(range(0, len(chunks), self.world)) - len(range(self.rank, len(chunks), self.world))
            for _ in range(missing):
                self._forward(self.task.collate(chunks[0]).to(self.device))
        self.model.train()
        # every rank's sums (on other ranks the row goes to NullCallbacks)
        loss_sum, total_units = metric_sums.reduce([loss_sum, units], self.device)
        units = round(total_units)
        return {
            "valid_loss": loss_sum / max(1, units),
            **{f"valid_{key}": value for key, value in metric_sums.means(max(1, units)).items()},
        }

    # -- checkpoints ----------------------------------------------------------------------------------
    def _save_due(self) -> bool:
        """Every ``save_steps`` steps, and at least every ``save_minutes`` of training (not at the end:
        the final checkpoint follows)."""
        s, step = self.s, self.state.step
        if step >= self.total_steps:
            return False
        if s.save_steps > 0 and step % s.save_steps == 0:
            return True
        return s.save_minutes > 0 and clock() - self.saved_at >= 60.0 * s.save_minutes

    def _checkpoint_once(self, *, final: bool) -> CheckpointInfo | None:
        """Write a checkpoint of this step unless it is written already; every rank calls it."""
        if self.saved == (self.state.step, final):
            return self.last_ckpt
        self.saved = (self.state.step, final)
        task_state = None if final else self._task_state()  # a collective on several ranks
        model, optimizer_state = self.model, None
        if self.sharded:  # gather the whole weights and optimizer state (collectives) for rank 0
            whole = sharding.full_model_state(self.model)
            optimizer_state = None if final else sharding.full_optimizer_state(self.optimizer)
            if self.rank == 0:
                model = sharding.unsharded_copy(self.model, whole)
        if self.rank != 0:  # the weights are the same on every rank: rank 0 writes the one copy
            return None
        st = self.state
        ckpt = save_checkpoint(
            self.s.output_dir,
            model=model,
            tokenizer=self.task.tokenizer,
            state=st,
            epoch=self._epoch_progress(),
            final=final,
            optimizer=None if final else self.optimizer,
            scheduler=None if final else self.scheduler,
            scaler=None if final else self.scaler,
            task_state=task_state,
            optimizer_state=optimizer_state,
        )
        self.last_ckpt = ckpt
        self.cb.on_checkpoint(ckpt)
        if not final:
            self.saved_at = clock()
            prune_checkpoints(self.s.output_dir, keep=self.s.keep_checkpoints)
        return ckpt

    def _task_state(self) -> dict[str, Any] | None:
        """The method's state: the preparer's of every rank (each holds its own share of the rollout in
        use), and the extra trainable module (the same on every rank)."""
        task = self.task
        if task.preparer is None and task.extra_trainable is None:
            return None
        preparers = dist.gather_objects(task.preparer.state_dict() if task.preparer is not None else {})
        extra: dict[str, torch.Tensor] = {}
        if task.extra_trainable is not None:  # whole, on rank 0, when sharded (a collective)
            extra = (
                sharding.full_model_state(task.extra_trainable)
                if self.sharded
                else task.extra_trainable.state_dict()
            )
        return {"preparer": preparers[0], "preparer_by_rank": preparers, "extra_trainable": extra}

    def _load_task_state(self, state: dict[str, Any] | None) -> None:
        task = self.task
        if task.preparer is None and task.extra_trainable is None:
            return
        if state is None:
            raise ValueError(f"{self.s.resume_from}: this checkpoint has no state for this method")
        if task.preparer is not None:
            by_rank = state.get("preparer_by_rank", [state["preparer"]])
            # a rollout in use was split over the ranks that wrote it: on as many ranks, each takes its
            # own share back; on another number, the step samples a fresh rollout with the current policy
            if len(by_rank) == self.world:
                task.preparer.load_state_dict(by_rank[self.rank])
        if task.extra_trainable is not None and self.sharded:
            sharding.load_full_state(task.extra_trainable, state["extra_trainable"])
        elif task.extra_trainable is not None:
            task.extra_trainable.load_state_dict(state["extra_trainable"])


class _MetricSums:
    """The metric sums of a step's (or an evaluation's) micro-batches, and their units."""

    def __init__(self) -> None:
        self.sums: dict[str, float | torch.Tensor] = {}
        self.units: dict[str, float] = {}

    def add(self, out: LossSums) -> None:
        for key, value in out.metrics.items():
            value = value.detach() if isinstance(value, torch.Tensor) else value
            self.sums[key] = self.sums.get(key, 0.0) + value
        for key, value in out.metric_units.items():
            self.units[key] = self.units.get(key, 0.0) + value

    def reduce(self, extra: list[float], device: torch.device) -> list[float]:
        """Sum these metric sums and units, and ``extra``, over all ranks (one collective); returns the
        summed ``extra``. A rank that ran no micro-batch has no keys: the key set is agreed first."""
        if dist.world_size() == 1:
            return extra
        sums, units = dist.union_keys(self.sums), dist.union_keys(self.units)
        values = (
            extra + [float(self.sums.get(k, 0.0)) for k in sums] + [self.units.get(k, 0.0) for k in units]
        )
        out = dist.sum_floats(values, device)
        n = len(extra)
        self.sums = dict(zip(sums, out[n : n + len(sums)], strict=True))
        self.units = dict(zip(units, out[n + len(sums) :], strict=True))
        return out[:n]

    def means(self, denominator: float) -> dict[str, float]:
        """Each metric over its own units where it has them (omitted when they sum to 0), else over
        ``denominator``."""
        return {
            key: float(value) / self.units[key] if key in self.units else float(value) / denominator
            for key, value in self.sums.items()
            if self.units.get(key, 1.0) > 0
        }


def _fusable(params: list[torch.nn.Parameter]) -> bool:
    """Whether torch's fused AdamW kernel takes these parameters (floating point, on CPU or CUDA)."""
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def _param_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only; biases and norm scales (1-D) are not decayed, as in GPT-2 and Llama recipes."""
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _chunks(data: Sequence[E], size: int) -> Iterator[Sequence[E]]:
    for start in range(0, len(data), size):
        yield data[start : start + size]
