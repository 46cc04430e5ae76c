"""Turn a job's model name into a local Hugging Face folder: the bundled demo model (built once), a
base model of the catalogue (fetched once per host from the blob store), an operator-registered path,
a hub id, a fine-tuned model of the tenant (its final checkpoint, unpacked once into the data dir's model
cache), or a Tinker checkpoint of the tenant (its adapter merged into its base, once)."""

from __future__ import annotations

import fcntl
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from service.base_models.catalog import resolve_base_model
from service.base_models.fine_tuned import find_final_checkpoint
from service.base_models.tinker_checkpoints import TINKER_PATH_PREFIX, find_tinker_checkpoint
from service.config import Settings
from service.db import session_scope
from service.storage import BlobStore
from worker.base_model_cache import fetch_base_model


class ModelNotAvailable(Exception):
    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def _build_once(target: Path, build: Callable[[Path], object]) -> Path:
    """Build `target` if missing; a file lock keeps concurrent workers apart, a rename makes it atomic."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # an intermediate LoRA checkpoint is an adapter folder: adapter_config.json, no config.json
        if not any((target / name).exists() for name in ("config.json", "adapter_config.json")):
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
            build(tmp)
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
    return target


def ensure_tiny_model(target: Path) -> Path:
    from trainers.modeling.tiny_model import build_tiny_model

    return _build_once(target, build_tiny_model)


def unpack_checkpoint(settings: Settings, blobs: BlobStore, *, checkpoint_id: str, blob_key: str) -> Path:
    """A checkpoint's model folder, unpacked once into the data dir's model cache."""

    def unpack(tmp: Path) -> None:
        with blobs.open(blob_key) as fh, tarfile.open(fileobj=fh, mode="r|") as tar:
            tar.extractall(tmp, filter="data")

    return _build_once(settings.models_dir / "fine-tuned" / checkpoint_id, unpack)


def _merged_tinker_checkpoint(
    settings: Settings, blobs: BlobStore, tenant_id: str, checkpoint_id: str, blob_key: str, base_model: str
) -> Path:
    """A Tinker checkpoint as a whole model folder (its adapter merged into its run's base), built once:
    what a job or a training client trains from (inference loads the adapter on the base itself)."""
    adapter = unpack_checkpoint(settings, blobs, checkpoint_id=checkpoint_id, blob_key=blob_key)
    base = resolve_model_path(settings, blobs, tenant_id=tenant_id, name=base_model)

    def merge(tmp: Path) -> None:
        from trainers.modeling.generation import load_with_adapter

        model, tokenizer = load_with_adapter(base, adapter)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _build_once(settings.models_dir / "fine-tuned" / f"{checkpoint_id}-merged", merge)


def resolve_model_path(
    settings: Settings,
    blobs: BlobStore,
    *,
    tenant_id: str,
    name: str,
    param: str = "model",
    reward_model: bool = False,
    include_deleted: bool = False,
) -> str:
    """`include_deleted`: for a job's own inputs; a job created before its base model was deleted still
    trains from it (the blobs are kept until it ends, service/models_api/lifecycle.py)."""
    if name.startswith(("ft:", "ftckpt-", TINKER_PATH_PREFIX)):
        with session_scope() as session:
            tinker = find_tinker_checkpoint(session, tenant_id=tenant_id, name=name)
            found = (tinker.id, tinker.blob_key, tinker.base_model) if tinker else None
        if found is not None:
            return str(_merged_tinker_checkpoint(settings, blobs, tenant_id, *found))
    if name.startswith("ft:"):
        with session_scope() as session:
            ckpt = find_final_checkpoint(
                session,
                tenant_id=tenant_id,
                name=name,
                reward_model=reward_model,
                include_deleted=include_deleted,
            )
            key, ckpt_id = (ckpt.blob_key, ckpt.id) if ckpt else (None, None)
        if not key or ckpt_id is None:  # "": deleted, blobs already removed
            kind = "reward model" if reward_model else "fine-tuned model"
            raise ModelNotAvailable(f"{param}: no {kind} named '{name}' in this organization", param=param)

        return str(unpack_checkpoint(settings, blobs, checkpoint_id=ckpt_id, blob_key=key))
    entry = resolve_base_model(settings, name)
    if entry is None:
        raise ModelNotAvailable(f"model '{name}' is no longer available on this deployment", param=param)
    if entry.source == "builtin":
        return str(ensure_tiny_model(settings.models_dir / "tiny-llama"))
    if entry.row is not None:  # the catalogue's: fetched once per host from the blob store
        row = entry.row
        return str(
            fetch_base_model(
                blobs,
                settings.base_models_dir,
                name=row.id,
                revision=row.revision,
                prefix=row.blob_prefix,
                files=row.files,
                cap_bytes=int(settings.model_cache_gb * 2**30),
            )
        )
    return entry.path or entry.id
