"""Write and read checkpoint folders, atomically.

Layout: ``{output_dir}/checkpoint-{step:06d}/`` holding

- ``model/``: a Hugging Face folder (safetensors + tokenizer). Intermediate checkpoints of a LoRA run
  hold the adapter only; the final checkpoint holds full weights, the adapter merged into the base, so
  it loads with ``AutoModelForCausalLM.from_pretrained`` and no peft (nor bitsandbytes: a quantized
  base is dequantized to the dtype it was loaded in, then merged, ``merged_model``).
- ``state/`` (not in the final checkpoint): ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` (fp16
  only), ``rng.pt``, ``trainer_state.json`` (step, data position, sampler permutation, metrics) and, for
  online methods, ``task.pt`` (the rollout in use, the value head: see ``trainers.core.loop.StepPreparer``).

A checkpoint is built in a temporary folder inside ``output_dir`` and renamed into place with
``os.replace``, so a crash never leaves a half-written ``checkpoint-*`` folder behind. A resumable one
also carries ``state/manifest.json``, written last: every file of ``model/`` and ``state/`` with its
size. Loading verifies it (``verify_checkpoint``), so a copy that lost files or was truncated on its way
(a blob store, a tar, a full disk) is refused and the caller falls back to an earlier checkpoint
(``latest_checkpoint`` does that for a local folder). Sizes, not hashes: hashing the optimizer state of
a large model at every save would stall training for tens of seconds; safetensors and torch's zip
format check their own headers.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from peft import PeftConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.processing_utils import ProcessorMixin

from trainers.core.callbacks import CheckpointInfo
from trainers.core.rng import capture_rng_state, restore_rng_state

FORMAT_VERSION = 1
MODEL_DIR, STATE_DIR = "model", "state"
TASK_STATE = "task.pt"
MANIFEST = "manifest.json"
ADAPTER_FILE = "adapter_model.safetensors"  # peft's name for a LoRA checkpoint's weights
_CHECKPOINT_GLOB = "checkpoint-*"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be resumed from: incomplete, truncated or of another format."""


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
    tokenizer: PreTrainedTokenizerBase | ProcessorMixin,
    state: LoopState,
    epoch: float,
    final: bool,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    scaler: torch.amp.GradScaler | None = None,
    task_state: dict[str, Any] | None = None,
    optimizer_state: dict[str, Any] | None = None,
) -> CheckpointInfo:
    """Write a checkpoint; training state is written when ``optimizer`` is given (its state is
    ``optimizer_state`` when given: a sharded optimizer's, gathered whole, ``trainers.core.sharding``).

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
            full = optimizer_state if optimizer_state is not None else optimizer.state_dict()
            torch.save(full, state_dir / "optimizer.pt")
            if scheduler is not None:
                torch.save(scheduler.state_dict(), state_dir / "scheduler.pt")
            if scaler is not None:
                torch.save(scaler.state_dict(), state_dir / "scaler.pt")
            torch.save(capture_rng_state(), state_dir / "rng.pt")
            if task_state is not None:
                torch.save(task_state, state_dir / TASK_STATE)
            payload = {"format_version": FORMAT_VERSION, **asdict(state)}
            (state_dir / "trainer_state.json").write_text(json.dumps(payload), encoding="utf-8")
            _write_manifest(tmp)
        target = checkpoint_dir(out, state.step)
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return CheckpointInfo(path=target, step=state.step, epoch=epoch, final=final, metrics=dict(state.metrics))


def _write_manifest(folder: Path) -> None:
    files = {
        str(p.relative_to(folder)): p.stat().st_size
        for part in (MODEL_DIR, STATE_DIR)
        for p in sorted((folder / part).rglob("*"))
        if p.is_file()
    }
    manifest = {"format_version": FORMAT_VERSION, "files": files}
    (folder / STATE_DIR / MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")


def verify_checkpoint(ckpt: str | Path) -> None:
    """Raise ``CheckpointError`` unless ``ckpt`` is a complete resumable checkpoint (see the manifest)."""
    folder = Path(ckpt)
    path = folder / STATE_DIR / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files: dict[str, int] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{ckpt} is not a complete resumable checkpoint (no valid {path.name})"
        ) from exc
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt}: unsupported checkpoint format")
    for name, size in files.items():
        file = folder / name
        actual = file.stat().st_size if file.is_file() else None
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes"
            raise CheckpointError(f"{ckpt}: {name} is {found}, expected {size} bytes")


def load_loop_state(ckpt: str | Path) -> LoopState:
    verify_checkpoint(ckpt)
    path = Path(ckpt) / STATE_DIR / "trainer_state.json"
    payload = json.loads(path.read_text(encoding="utf-8"))
    if payload.pop("format_version", None) != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt}: unsupported checkpoint format")
    return LoopState(**payload)


def resumable_checkpoints(output_dir: str | Path) -> list[Path]:
    """The ``checkpoint-*`` folders with a training state, newest (highest step) first; unverified."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [p for p in out.glob(_CHECKPOINT_GLOB) if (p / STATE_DIR).is_dir() and _step_of(p) is not None]
    return sorted(found, key=lambda p: _step_of(p) or 0, reverse=True)


def _step_of(path: Path) -> int | None:
    suffix = path.name.removeprefix("checkpoint-")
    return int(suffix) if suffix.isdigit() else None


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest checkpoint in ``output_dir`` that verifies, skipping incomplete or truncated ones."""
    for path in resumable_checkpoints(output_dir):
        try:
            verify_checkpoint(path)
        except CheckpointError:
            continue
        return path
    return None


def prune_checkpoints(output_dir: str | Path, *, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` resumable checkpoints (final exports are kept); returns them."""
    old = resumable_checkpoints(output_dir)[max(1, keep) :]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def restore_training_state(
    ckpt: str | Path,
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    scaler: torch.amp.GradScaler | None = None,
    reshard: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> LoopState:
    """Load optimizer, scheduler, scaler and RNG states in place; return the loop state. ``reshard``
    cuts the saved (whole) optimizer state to a sharded optimizer's (``trainers.core.sharding``)."""
    state = load_loop_state(ckpt)
    state_dir = Path(ckpt) / STATE_DIR
    optimizer_state = _load(state_dir / "optimizer.pt")
    optimizer.load_state_dict(reshard(optimizer_state) if reshard is not None else optimizer_state)
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


@runtime_checkable
class SavesItself(Protocol):
    """A trained module that writes its own ``model/`` folder: one whose trainable weights are not a
    transformers or peft model's alone (a reward model's head beside a shared base's adapter,
    ``trainers.modeling.adapter_classifier``). It writes what the lone model would."""

    def save_trained(self, path: Path, *, final: bool) -> None: ...


def _save_model(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase | ProcessorMixin, path: Path, *, final: bool
) -> None:
    if isinstance(model, SavesItself):
        model.save_trained(path, final=final)
    elif isinstance(model, PeftModel) and model.active_adapter != "default":
        # one of several jobs' adapters on a shared base (trainers/families/shared_base.py): this one's
        # alone, in the same files as a job's own; the export merges into a copy of the base weights
        if final:
            _export_merged_copy(model, path)
        else:
            save_active_adapter(model, path)
    elif isinstance(model, PeftModel):
        if final:
            _export(merged_model(model), path)
        else:
            model.save_pretrained(str(path))  # the adapter only
    else:
        assert isinstance(model, PreTrainedModel)
        if final:
            _export(model, path)
        else:
            model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def merged_model(model: PeftModel) -> PreTrainedModel:
    """The LoRA ``model`` with its adapter merged into the base weights (in place: ``model`` is spent).

    A quantized base (``quantization``, bitsandbytes) is first dequantized to the dtype it was loaded in
    and the adapter merged into that in full: the merged layer computes what the trained one did (the
    adapter learnt beside the dequantized weights, not the original ones), and nothing is quantized
    again. peft's own merge into a 4-bit layer would re-quantize ``W + BA``, losing most of the update
    (NF4 has 16 levels per block: a small update mostly rounds away) and exporting a 4-bit model."""
    base = model.get_base_model()
    if not getattr(base, "is_quantized", False):
        merged = model.merge_and_unload()
        assert isinstance(merged, PreTrainedModel)
        return merged
    config = model.peft_config[model.active_adapter]
    trained = get_peft_model_state_dict(model)  # the adapter and any fully trained head (modules_to_save)
    plain = model.unload()
    assert isinstance(plain, PreTrainedModel)
    # also drops the quantization config: a plain model now
    plain.dequantize(dtype=plain.config.dtype)  # type: ignore[no-untyped-call]
    device = next(plain.parameters()).device
    # a new adapter draws its initial weights before they are overwritten: leave the caller's RNG alone
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        warnings.catch_warnings(),
    ):
        # peft 0.21 reads `model.is_gradient_checkpointing`, which transformers 5 deprecates
        warnings.filterwarnings(
            "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        adapted = get_peft_model(plain, config)
    set_peft_model_state_dict(adapted, trained)
    merged = adapted.merge_and_unload()
    assert isinstance(merged, PreTrainedModel)
    return merged


def save_active_adapter(
    model: PeftModel,
    path: Path,
    *,
    config: PeftConfig | None = None,
    extra: dict[str, torch.Tensor] | None = None,
) -> None:
    """The active adapter as ``save_pretrained`` writes a lone "default" one (``adapter_config.json`` and
    ``adapter_model.safetensors`` in ``path``, not in a folder named after the adapter); ``config`` in
    place of the adapter's own, ``extra`` tensors beside its weights."""
    name = model.active_adapter
    path.mkdir(parents=True, exist_ok=True)
    (config or model.peft_config[name]).save_pretrained(str(path))
    weights = {**get_peft_model_state_dict(model, adapter_name=name), **(extra or {})}
    save_file({k: v.detach().contiguous() for k, v in weights.items()}, path / ADAPTER_FILE)


def load_adapter_file(model_folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of a LoRA checkpoint's ``model/`` folder (the adapter's, and a trained head's)."""
    return load_file(model_folder / ADAPTER_FILE)


@torch.no_grad()
def merged_copy_weights(model: PeftModel) -> dict[str, torch.Tensor]:
    """The base's weights under a plain model's names with the active adapter merged, as ``merged_model``
    computes them, but in new tensors: the base's own stay as they are (other jobs train on them). Costs
    one copy of the adapted layers' weights (of every quantized layer's, dequantized, for a quantized
    base)."""
    name = model.active_adapter
    base = model.get_base_model()
    assert isinstance(base, PreTrainedModel)
    weights = _plain_weights(base)
    for module_name, module in base.named_modules():
        if isinstance(module, LoraLayer) and name in module.lora_A:
            key = f"{module_name}.weight"
            delta = module.get_delta_weight(name)  # type: ignore[attr-defined]  # (every LoRA layer kind)
            weights[key] = weights[key] + delta.to(weights[key].dtype)
    return weights


def save_as_plain(
    build: Callable[..., PreTrainedModel],
    config: PretrainedConfig,
    weights: dict[str, torch.Tensor],
    path: Path,
    *,
    dtype: torch.dtype,
    generation_config: GenerationConfig | None = None,
) -> None:
    """Save ``weights`` as the model ``build(config, dtype=dtype)`` gives, less any quantization, for
    inference (with ``generation_config``, where given). Written through a weightless copy of that
    model (on the meta device): a quantized model saves its own quantized weights whatever it is given,
    and a classifier is another class than the causal LM its weights come from."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.use_cache = True  # as `_export`
    with torch.device("meta"):
        plain = build(config, dtype=dtype)
    if generation_config is not None:
        plain.generation_config = generation_config
    plain.save_pretrained(path, state_dict=weights)


def _export_merged_copy(model: PeftModel, path: Path) -> None:
    """Export the base with the active adapter merged into copies of its weights (``merged_copy_weights``)."""
    base = model.get_base_model()
    assert isinstance(base, PreTrainedModel)
    weights = merged_copy_weights(model)
    if not getattr(base, "is_quantized", False):
        base.config.use_cache = True  # as `_export`
        base.save_pretrained(path, state_dict=weights)
        return
    save_as_plain(
        type(base)._from_config,
        base.config,
        weights,
        path,
        dtype=loaded_dtype(base),
        generation_config=base.generation_config,
    )


def _plain_weights(base: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The base model's weights under a plain model's names, without the adapters' (a LoRA-wrapped
    layer's own weight under the layer's name); a quantized layer's dequantized to the dtype the model
    was loaded in, as ``merged_model`` does."""
    dequantized = _dequantized_linears(base)
    weights: dict[str, torch.Tensor] = {}
    for key, value in base.state_dict().items():
        layer, _, leaf = key.rpartition(".weight.")
        if ".lora_" in key or (leaf and layer in dequantized):  # an adapter's; a quantized weight's state
            continue
        weights[key] = value
    for layer, weight in dequantized.items():
        weights[f"{layer}.weight"] = weight
    return {key.replace(".base_layer.", "."): value for key, value in weights.items()}


def _dequantized_linears(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Each quantized linear layer's weight (by the layer's name), dequantized to the dtype the model was
    loaded in: new tensors, the model's own stay quantized (jobs on a shared base still train on them).
    Empty for a model without quantized layers (``trainers.modeling.quantization``). Only then is
    bitsandbytes imported: trainers of unquantized jobs run without it (worker/launch.py)."""
    if not getattr(model, "is_quantized", False):
        return {}
    from transformers.integrations.bitsandbytes import dequantize_bnb_weight

    dtype = loaded_dtype(model)
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and type(weight).__name__ in ("Params4bit", "Int8Params"):
            state = getattr(module, "state", None)  # an 8-bit layer's scales
            out[name] = dequantize_bnb_weight(weight, state).to(dtype)
    return out


def loaded_dtype(model: PreTrainedModel) -> torch.dtype:
    """The dtype the model was loaded in (its config's; `save_pretrained` leaves it a string there)."""
    dtype = model.config.dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    assert isinstance(dtype, torch.dtype), dtype
    return dtype


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
