"""Several LoRA jobs training in one process on one copy of their base model.

A LoRA job trains a few million adapter weights beside a frozen base of billions; jobs on the same base
(a learning-rate sweep, teams tuning one model) need the base once. A ``SharedBase`` holds it and gives
each job its own named adapter on it; each job keeps everything else of its own: optimizer, data order,
random state, schedule, checkpoints and reports, since each runs the ordinary method code and loop in a
thread of its own (worker/shared_base_host.py starts those threads).

One job at a time. A job's thread holds the model from its start to its end except between optimizer
steps and while its checkpoints upload (``trainers.core.turns``), where it passes the turn to the next
waiting job in arrival order and then waits for its own. Whoever holds the turn has its adapter active
and its own random state in the global generators (dropout, sampling), so each job computes what it
would alone: the same seed gives the same adapter initialisation, batches and losses as a run in a
process of its own (tests hold this).
Interleaving whole steps rather than batching the jobs' rows through one forward (multi-LoRA batching)
keeps each step exactly the solo step, and on a CPU batching is no quicker: one pass over four jobs'
rows through one adapter, a lower bound of a batch's cost, took 0.87-1.07x the four passes in turn
(bench/multi_lora_batching.py, docs/benchmarks.md). Whether it pays on a GPU that bench decides.

What differs from a job alone is only where the trainable weights live: its adapter is one of several
on the model (``attach``), its checkpoints hold that adapter alone, and its final export merges it into
a copy of the base weights instead of into the base itself (``trainers.core.checkpoint``), which the
other jobs still train on. The last job to leave frees the base.

Eligible: every LoRA job, quantized or not (``shareable``). A reward model trains a classifier, which on
a shared base is the causal LM's decoder under the job's adapter and a head the job holds itself
(``attach_classifier``); a model a method only reads (a reward model scoring rollouts) it loads its
own, in its turn.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel

from trainers.core import turns
from trainers.core.checkpoint import MODEL_DIR
from trainers.core.rng import capture_rng_state, restore_rng_state
from trainers.kernels.install import install_kernels
from trainers.modeling.adapter_classifier import AdapterClassifier, untrained_head
from trainers.modeling.loading import (
    ModelSettings,
    load_model,
    lora_base_dtype,
    lora_config,
    restore_adapter,
)

_local = threading.local()


class _FairTurn:
    """A lock handed to its waiters in arrival order. A plain lock wakes any waiter, and a thread that
    releases and at once acquires again usually wins it back: the other jobs would starve."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: deque[object] = deque()
        self._held = False

    def acquire(self) -> None:
        me = object()
        with self._cond:
            self._waiting.append(me)
            self._cond.wait_for(lambda: not self._held and self._waiting[0] is me)
            self._waiting.popleft()
            self._held = True

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()


@dataclass(frozen=True)
class BaseKey:
    """What must be equal for two jobs to train on one copy of the base: the weights, their dtype (from
    the precision) and quantization, the kernels installed on the model, and the device."""

    model_path: str
    mixed_precision: str
    quantization: str | None
    gradient_checkpointing: bool
    device: str


def shareable(settings: ModelSettings) -> bool:
    """Whether a job with these settings can train on a shared base: a LoRA adapter (on a quantized
    base too: QLoRA jobs share the 4-bit weights, and each export dequantizes a copy)."""
    return settings.use_lora


class SharedBase:
    """One base model and the adapters of the jobs training on it (see the module's docstring)."""

    def __init__(self) -> None:
        self._turn = _FairTurn()
        self._model: PeftModel | None = None
        self._key: BaseKey | None = None
        self._lock = threading.Lock()  # the adapter names, read by `jobs` from other threads
        self._names: list[str] = []

    @property
    def jobs(self) -> list[str]:
        """The adapters on the base now (job ids)."""
        with self._lock:
            return list(self._names)

    @contextmanager
    def seat(self, name: str) -> Iterator[None]:
        """Train as ``name`` in this thread for the duration: waits for the turn, holds it but between
        optimizer steps, and on leaving removes the adapter (or frees the base, if it was the last)."""
        self._turn.acquire()
        _local.seat = (self, name)
        turns.set_turn(_Seat(self, name))
        try:
            yield
        finally:
            turns.set_turn(None)
            _local.seat = None
            try:
                self._detach(name)
            finally:
                self._turn.release()

    def attach(self, name: str, settings: ModelSettings, device: torch.device) -> PeftModel:
        """The shared model with adapter ``name`` added (its weights from ``settings.resume_from`` when
        resuming) and active; the first job loads the base, with the kernels of its settings."""
        if not shareable(settings):
            raise ValueError("a shared base trains LoRA adapters only")
        key = BaseKey(
            settings.model_path,
            settings.mixed_precision,
            settings.quantization,
            settings.gradient_checkpointing,
            str(device),
        )
        if self._model is None:
            model = load_model(settings, device, adapter_name=name)
            assert isinstance(model, PeftModel)
            install_kernels(model, settings, device)
            self._model, self._key = model, key
        else:
            if key != self._key:
                raise ValueError(f"job {name} needs base {key}, this process holds {self._key}")
            self._model.add_adapter(name, lora_config(settings, self._model))
            if settings.resume_from:
                restore_adapter(self._model, Path(settings.resume_from) / MODEL_DIR, name)
        self._model.set_adapter(name)
        with self._lock:
            self._names.append(name)
        return self._model

    def attach_classifier(
        self, name: str, settings: ModelSettings, device: torch.device, *, pad_token_id: int
    ) -> AdapterClassifier:
        """A reward model on the shared base: ``attach``'s adapter under a scalar head of the job's own
        (``trainers.modeling.adapter_classifier``), the head restored from ``settings.resume_from`` when
        resuming."""
        # drawn first, as a lone reward model draws its head while loading, before its adapter
        head = untrained_head(settings.model_path, lora_base_dtype(settings, device), device)
        classifier = AdapterClassifier(self.attach(name, settings, device), name, head, pad_token_id)
        if settings.resume_from:
            classifier.restore_head(Path(settings.resume_from) / MODEL_DIR)
        return classifier

    def _detach(self, name: str) -> None:
        with self._lock:
            if name not in self._names:
                return
            self._names.remove(name)
            last = not self._names
        assert self._model is not None
        if last:
            self._model, self._key = None, None  # nobody trains on it now: free it
        else:
            with warnings.catch_warnings():  # "Adapter X was active which is now deleted": as meant
                warnings.simplefilter("ignore", UserWarning)
                self._model.delete_adapter(name)


class _Seat:
    """One job's hold on the shared base (``trainers.core.turns.Turn``): what it keeps aside while the
    others use the model, put back when it has the turn again."""

    def __init__(self, base: SharedBase, name: str) -> None:
        self._base, self._name = base, name
        self._rng: dict[str, Any] = {}
        self._training = True

    def leave(self) -> None:
        self._rng = capture_rng_state()
        model = self._base._model
        self._training = model.training if model is not None else True
        self._base._turn.release()

    def retake(self) -> None:
        self._base._turn.acquire()
        restore_rng_state(self._rng)
        model = self._base._model
        if model is not None and self._name in model.peft_config:
            model.set_adapter(self._name)
            model.train(self._training)  # another job may have evaluated meanwhile


def seat_of_this_thread() -> tuple[SharedBase, str] | None:
    """The shared base and adapter name this thread trains as, if it runs a job on a shared base."""
    seat: Any = getattr(_local, "seat", None)
    return seat if isinstance(seat, tuple) else None
