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
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Generic, Protocol, Self, TypeVar

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from trainers.callbacks import CheckpointInfo, NullCallbacks, StopRequest, TrainingCallbacks, TrainResult
from trainers.checkpoint import LoopState, restore_training_state, save_checkpoint
from trainers.modeling import autocast_dtype
from trainers.schedule import build_scheduler

__all__ = [
    "Batch",
    "CheckpointInfo",
    "LoopSettings",
    "LossSums",
    "NullCallbacks",
    "StopRequest",
    "TrainResult",
    "TrainingCallbacks",
    "TrainingTask",
    "run_training",
]


class LoopSettings(Protocol):
    """The optimisation fields every method config has (see ``trainers.sft.SFTConfig``)."""

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
    loss: torch.Tensor  # scalar, summed over the micro-batch's loss units
    metrics: dict[str, float]  # also sums over those units; reported divided by their count


E = TypeVar("E")
B = TypeVar("B", bound=Batch)


@dataclass
class TrainingTask(Generic[E, B]):
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    train_data: Sequence[E]
    collate: Callable[[Sequence[E]], B]
    loss_fn: Callable[[torch.nn.Module, B], LossSums]
    valid_data: Sequence[E] | None = None


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
        self.s, self.task, self.cb = settings, task, callbacks
        self.model = task.model
        self.device = next(self.model.parameters()).device
        self.compute_dtype = autocast_dtype(settings.mixed_precision, self.device)
        n = len(task.train_data)
        self.micro_per_epoch = math.ceil(n / settings.batch_size)
        self.steps_per_epoch = math.ceil(self.micro_per_epoch / settings.gradient_accumulation_steps)
        total = self.steps_per_epoch * settings.n_epochs
        self.total_steps = min(total, settings.max_steps) if settings.max_steps is not None else total
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            _param_groups(self.params, settings.weight_decay), lr=settings.learning_rate
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

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        if self.s.resume_from:
            self.state = restore_training_state(
                self.s.resume_from, optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler
            )
            self.state.total_steps = self.total_steps
            if len(self.state.permutation) != len(self.task.train_data):
                raise ValueError(f"{self.s.resume_from}: the training data changed since this checkpoint")
        else:
            self.state.permutation = epoch_permutation(self.s.seed, 0, len(self.task.train_data))
        self.cb.on_train_begin(total_steps=self.total_steps, n_epochs=self.s.n_epochs)
        self.model.train()
        while self.state.step < self.total_steps:
            stop = self.cb.should_stop()
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
            save_every = self.s.save_steps
            if save_every > 0 and self.state.step % save_every == 0 and self.state.step < self.total_steps:
                self._checkpoint_once(final=False)
        final = self._checkpoint_once(final=True)
        return TrainResult(final, None, self.state.step, dict(self.state.metrics))

    def _train_step(self) -> bool:
        """One optimizer step; returns whether it finished an epoch."""
        s, st = self.s, self.state
        first = st.batch_index
        last = min(first + s.gradient_accumulation_steps, self.micro_per_epoch)
        batches = [self._micro_batch(st.permutation, i) for i in range(first, last)]
        denominator = max(1, sum(b.loss_denominator for b in batches))
        start = time.perf_counter()
        loss_sum, metric_sums = 0.0, dict[str, float]()
        for batch in batches:
            out = self._forward(batch.to(self.device))
            scaled = out.loss / denominator
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()  # type: ignore[no-untyped-call]
            loss_sum += float(out.loss.detach().item())
            for key, value in out.metrics.items():
                metric_sums[key] = metric_sums.get(key, 0.0) + value
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

        n_tokens = sum(b.n_tokens for b in batches)
        st.step += 1
        st.batch_index = last
        st.trained_tokens += n_tokens
        epoch = st.epoch + st.batch_index / self.micro_per_epoch
        row = {
            "step": float(st.step),
            "epoch": epoch,
            "loss": loss_sum / denominator,
            "learning_rate": learning_rate,
            "grad_norm": grad_norm,
            "tokens_per_second": n_tokens / elapsed if elapsed > 0 else 0.0,
            **{key: value / denominator for key, value in metric_sums.items()},
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

    def _micro_batch(self, order: Sequence[int], index: int) -> B:
        size = self.s.batch_size
        return self.task.collate([self.task.train_data[i] for i in order[index * size : (index + 1) * size]])

    def _forward(self, batch: B) -> LossSums:
        dtype = self.compute_dtype
        ctx = torch.autocast(self.device.type, dtype=dtype) if dtype is not None else nullcontext()
        with ctx:
            return self.task.loss_fn(self.model, batch)

    # -- evaluation -----------------------------------------------------------------------------------
    def _eval_due(self, epoch_done: bool) -> bool:
        if not self.task.valid_data:
            return False
        if self.state.step == self.total_steps:
            return True
        if self.s.eval_steps > 0:
            return self.state.step % self.s.eval_steps == 0
        return epoch_done

    @torch.no_grad()
    def _evaluate(self) -> None:
        data = self.task.valid_data or []
        self.model.eval()
        loss_sum, units, metric_sums = 0.0, 0, dict[str, float]()
        for batch in _chunks(data, self.s.batch_size):
            collated = self.task.collate(batch)
            out = self._forward(collated.to(self.device))
            loss_sum += float(out.loss.item())
            units += collated.loss_denominator
            for key, value in out.metrics.items():
                metric_sums[key] = metric_sums.get(key, 0.0) + value
        self.model.train()
        st = self.state
        row = {
            "step": float(st.step),
            "epoch": st.epoch + st.batch_index / self.micro_per_epoch,
            "valid_loss": loss_sum / max(1, units),
            **{f"valid_{key}": value / max(1, units) for key, value in metric_sums.items()},
        }
        st.metrics = {**st.metrics, **{k: v for k, v in row.items() if k.startswith("valid_")}}
        self.cb.on_eval(row)

    # -- checkpoints ----------------------------------------------------------------------------------
    def _checkpoint_once(self, *, final: bool) -> CheckpointInfo:
        last = self.last_ckpt
        if last is not None and last.step == self.state.step and last.final == final:
            return last
        st = self.state
        ckpt = save_checkpoint(
            self.s.output_dir,
            model=self.model,
            tokenizer=self.task.tokenizer,
            state=st,
            epoch=st.epoch + st.batch_index / self.micro_per_epoch,
            final=final,
            optimizer=None if final else self.optimizer,
            scheduler=None if final else self.scheduler,
            scaler=None if final else self.scaler,
        )
        self.last_ckpt = ckpt
        self.cb.on_checkpoint(ckpt)
        return ckpt


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
