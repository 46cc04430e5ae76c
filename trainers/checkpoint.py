"""Write and read checkpoint folders, atomically.

Layout: ``{output_dir}/checkpoint-{step:06d}/`` holding

- ``model/``: a Hugging Face folder (safetensors + tokenizer). Intermediate checkpoints of a LoRA run
  hold the adapter only; the final checkpoint holds full weights, the adapter merged into the base, so
  it loads with ``AutoModelForCausalLM.from_pretrained`` and no peft.
- ``state/`` (not in the final checkpoint): ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` (fp16
  only), ``rng.pt``, ``trainer_state.json`` (step, data position, sampler permutation, metrics) and, for
  online methods, ``task.pt`` (the rollout in use, the value head: see ``trainers.loop.StepPreparer``).

A checkpoint is built in a temporary folder inside ``output_dir`` and renamed into place with
``os.replace``, so a crash never leaves a half-written ``checkpoint-*`` folder behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trainers.callbacks import CheckpointInfo
from trainers.rng import capture_rng_state, restore_rng_state

FORMAT_VERSION = 1
MODEL_DIR, STATE_DIR = "model", "state"
TASK_STATE = "task.pt"


@dataclass
class LoopState:
    """Where a run stands between two optimizer steps; enough, with the tensors, to resume exactly."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # 0-based epoch in progress
    batch_index: int = 0  # next micro-batch of that epoch
    repeat: int = 0  # optimizer steps already done on that micro-batch group (online methods reuse rollouts)
    trained_tokens: int = 0
    sampler_seed: int = 0
    permutation: list[int] = field(default_factory=list)  # example order of the epoch in progress
    total_steps: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step:06d}"


def save_checkpoint(
    output_dir: str | Path,
    *,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    state: LoopState,
    epoch: float,
    final: bool,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    scaler: torch.amp.GradScaler | None = None,
    task_state: dict[str, Any] | None = None,
) -> CheckpointInfo:
    """Write a checkpoint; training state is written when ``optimizer`` is given.

    A final checkpoint of a LoRA model merges the adapter into the base weights in place: the model
    cannot be trained further afterwards.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-checkpoint-{state.step:06d}-", dir=out))
    try:
        _save_model(model, tokenizer, tmp / MODEL_DIR, final=final)
        if optimizer is not None:
            state_dir = tmp / STATE_DIR
            state_dir.mkdir()
            torch.save(optimizer.state_dict(), state_dir / "optimizer.pt")
            if scheduler is not None:
                torch.save(scheduler.state_dict(), state_dir / "scheduler.pt")
            if scaler is not None:
                torch.save(scaler.state_dict(), state_dir / "scaler.pt")
            torch.save(capture_rng_state(), state_dir / "rng.pt")
            if task_state is not None:
                torch.save(task_state, state_dir / TASK_STATE)
            payload = {"format_version": FORMAT_VERSION, **asdict(state)}
            (state_dir / "trainer_state.json").write_text(json.dumps(payload), encoding="utf-8")
        target = checkpoint_dir(out, state.step)
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return CheckpointInfo(path=target, step=state.step, epoch=epoch, final=final, metrics=dict(state.metrics))


def load_loop_state(ckpt: str | Path) -> LoopState:
    path = Path(ckpt) / STATE_DIR / "trainer_state.json"
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt} is not a resumable checkpoint (no {STATE_DIR}/trainer_state.json)")
    payload = json.loads(path.read_text(encoding="utf-8"))
    if payload.pop("format_version", None) != FORMAT_VERSION:
        raise ValueError(f"{ckpt}: unsupported checkpoint format")
    return LoopState(**payload)


def restore_training_state(
    ckpt: str | Path,
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> LoopState:
    """Load optimizer, scheduler, scaler and RNG states in place; return the loop state."""
    state = load_loop_state(ckpt)
    state_dir = Path(ckpt) / STATE_DIR
    optimizer.load_state_dict(_load(state_dir / "optimizer.pt"))
    if scheduler is not None:
        scheduler.load_state_dict(_load(state_dir / "scheduler.pt"))
    if scaler is not None and (state_dir / "scaler.pt").is_file():
        scaler.load_state_dict(_load(state_dir / "scaler.pt"))
    restore_rng_state(_load(state_dir / "rng.pt"))
    return state


def load_task_state(ckpt: str | Path) -> dict[str, Any] | None:
    """The method's own state saved with ``task_state`` (None when there is none)."""
    path = Path(ckpt) / STATE_DIR / TASK_STATE
    return _load(path) if path.is_file() else None


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _save_model(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, path: Path, *, final: bool
) -> None:
    if isinstance(model, PeftModel):
        if final:
            merged = model.merge_and_unload()
            assert isinstance(merged, PreTrainedModel)
            _export(merged, path)
        else:
            model.save_pretrained(str(path))  # the adapter only
    else:
        assert isinstance(model, PreTrainedModel)
        if final:
            _export(model, path)
        else:
            model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _export(model: PreTrainedModel, path: Path) -> None:
    """Save for inference: gradient checkpointing turns the KV cache off in the config; turn it back on."""
    model.config.use_cache = True
    model.save_pretrained(path)


def _replace_dir(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``, replacing an existing ``dst`` (``os.replace`` only replaces empty folders)."""
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".old-{dst.name}-", dir=dst.parent))
        os.replace(dst, old / dst.name)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
