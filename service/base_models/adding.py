"""`tunehouse models add`: a base model into the catalogue, stored once in the blob store.

The source is a local Hugging Face folder or a hub id. A hub id is fetched with `huggingface_hub` (its
`HF_ENDPOINT`, and `HF_TOKEN` or `--token` for a gated model), at the revision asked for or the branch's
current commit, which is then pinned: the row keeps the commit sha, and a later `add` of the same id
fetches again only if the commit changed. Only the files that load a model without remote code are kept
(configs, safetensors weights, tokenizer files, the chat template), each stored under
`base-models/<name>/<revision>/` with its sha256; workers fetch them from there on first use and check
every file against its sha256 (worker/base_model_cache.py). The row is written after every file is
stored, so a model is never listed with files missing.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy.orm import Session

from service.base_models.details import model_details
from service.models import CatalogModel
from service.storage import BlobStore
from trainers.tiny_spec import TINY_MODEL_NAME

# what a model needs to load with transformers and no remote code; other weights formats (.bin, .pt,
# .gguf, ONNX) and the repo's README, images and code stay on the hub
KEPT_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "merges.txt")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
CHUNK = 1024 * 1024


class AddError(Exception):
    """A refusal the CLI prints as one line."""


def _kept(path: Path, root: Path) -> bool:
    from fnmatch import fnmatch

    rel = path.relative_to(root)
    return not any(part.startswith(".") for part in rel.parts) and any(
        fnmatch(rel.name, pattern) for pattern in KEPT_FILES
    )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def _hub_errors(repo_id: str, revision: str | None) -> Iterator[None]:
    """The hub client's refusals as one line each."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        yield
    except GatedRepoError as exc:
        raise AddError(f"{repo_id} is gated: accept its terms on the hub and set HF_TOKEN") from exc
    except RevisionNotFoundError as exc:
        raise AddError(f"{repo_id} has no revision '{revision or 'main'}'") from exc
    except RepositoryNotFoundError as exc:
        raise AddError(
            f"no model '{repo_id}' on the hub ({os.environ.get('HF_ENDPOINT') or 'huggingface.co'}); "
            "a private one needs HF_TOKEN"
        ) from exc


def hub_commit(repo_id: str, *, revision: str | None, token: str | None) -> str:
    """The commit `revision` (default: the main branch) is now: what the catalogue pins."""
    from huggingface_hub import HfApi

    with _hub_errors(repo_id, revision):
        sha = HfApi(token=token).model_info(repo_id, revision=revision).sha
    if not sha:
        raise AddError(f"the hub gave no commit for {repo_id} at {revision or 'main'}")
    return sha


def fetch_from_hub(repo_id: str, *, commit: str, token: str | None, into: Path) -> Path:
    """The repo's kept files at `commit`, in a folder under `into`."""
    from huggingface_hub import snapshot_download

    with _hub_errors(repo_id, commit):
        folder = snapshot_download(
            repo_id, revision=commit, token=token, cache_dir=into, allow_patterns=list(KEPT_FILES)
        )
    return Path(folder)


def add_base_model(
    session: Session,
    blobs: BlobStore,
    source: str,
    *,
    name: str | None = None,
    revision: str | None = None,
    token: str | None = None,
    say: Callable[[str], None] = print,
) -> CatalogModel:
    """Store the model at `source` (a folder, or a hub id) under `name` (default: the hub id, or the
    folder's name) and record it; the caller commits."""
    local = Path(source).expanduser()
    model_name = name or (local.name if local.is_dir() else source)
    if not _NAME.match(model_name) or model_name.startswith("ft:") or model_name == TINY_MODEL_NAME:
        raise AddError(
            f"'{model_name}' cannot name a base model: use letters, digits, '.', '_', '-' and at most one "
            "'/' (pass --name)"
        )
    with tempfile.TemporaryDirectory(prefix="tunehouse-models-add-") as tmp:
        if local.is_dir():
            folder = local
        elif local.exists() or source.startswith(("/", ".", "~")):
            raise AddError(f"{source} is not a folder of a Hugging Face model")
        else:
            token = token or os.environ.get("HF_TOKEN") or None
            revision = hub_commit(source, revision=revision, token=token)
            existing = session.get(CatalogModel, model_name)
            if existing is not None and existing.revision == revision:
                say(f"{model_name} is already in the catalogue at {revision}")
                return existing
            say(f"fetching {source} at {revision} from the hub")
            folder = fetch_from_hub(source, commit=revision, token=token, into=Path(tmp))
        files = sorted(p for p in folder.rglob("*") if p.is_file() and _kept(p, folder))
        if not (folder / "config.json").is_file():
            raise AddError(f"{source} has no config.json: not a Hugging Face model")
        manifest = [
            {"path": p.relative_to(folder).as_posix(), "bytes": p.stat().st_size, "sha256": sha256_of(p)}
            for p in files
        ]
        if not local.is_dir():
            pinned = revision or ""
        else:  # a folder's revision: its files' manifest, so the same files are the same revision
            pinned = hashlib.sha256(repr(manifest).encode()).hexdigest()[:40]
        existing = session.get(CatalogModel, model_name)
        if existing is not None and existing.revision == pinned:
            say(f"{model_name} is already in the catalogue at {pinned}")
            return existing
        prefix = f"base-models/{model_name}/{pinned}"
        for entry, path in zip(manifest, files, strict=True):
            say(f"  storing {entry['path']} ({entry['bytes']} bytes)")
            blobs.put_file(f"{prefix}/{entry['path']}", path)
        details = model_details(folder)
    row = existing or CatalogModel(id=model_name)
    row.source, row.revision, row.blob_prefix = source, pinned, prefix
    row.files, row.bytes, row.details = manifest, sum(int(str(f["bytes"])) for f in manifest), details
    session.add(row)
    session.flush()
    return row
