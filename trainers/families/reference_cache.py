"""Reference log-probs kept between runs, so that a DPO run on pairs an earlier run already scored skips
the reference's pass over them: a sweep over β or the learning rate on one file, a job resumed after
a pause, requeued at its worker's shutdown or after its worker died (the job process stores the entries
once the pass is done, before the first step: ``worker.reference_log_probs``).

One ``.npz`` file holds up to ``MAX_ENTRIES`` entries, each the [N, 2] (chosen, rejected) log-probs of
one set of pairs under one reference. An entry's name is a digest of everything its values depend on:
the reference's weights and config, the pairs' token ids in order, the autocast dtype, the device type
and how pairs are packed. Nothing else changes a reference log-prob, so a run with another β, loss,
learning rate, seed or number of epochs finds the entry; one with another tokenizer, ``max_length``,
base model or precision does not. The batch size is not in the digest: log-probs computed at another
batch size differ by the precision's rounding only (other shapes, the same tokens), as they already
do between the pass that precomputes them and the training batches.

The file is plain data (``allow_pickle=False``); one that cannot be read is a miss and is rewritten.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from trainers.data.preference import PreferenceExample, VisionPair

log = logging.getLogger("tunehouse.trainers")

MAX_ENTRIES = 4  # the newest kept: a file scored under a few references (models, precisions) at a time
_FORMAT = b"tunehouse reference log-probs v1"


def reference_key(
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: dict[str, object],
    examples: Sequence[PreferenceExample],
    *,
    settings: str,
) -> str:
    """The digest naming one entry. ``tensors``: the reference's named weights and buffers, in a fixed
    order; ``config``: its model config (the path it was loaded from left out); ``settings``: the
    autocast dtype, device type and packing, as one string."""
    h = hashlib.sha256(_FORMAT)
    h.update(repr(sorted((k, repr(v)) for k, v in config.items() if k != "_name_or_path")).encode())
    h.update(settings.encode())
    for name, tensor in tensors:
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        h.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}".encode())
        h.update(flat.view(torch.uint8).numpy().data)
    h.update(len(examples).to_bytes(8, "little"))
    for e in examples:
        for ids in (e.prompt_ids, e.chosen_ids, e.rejected_ids):
            h.update(len(ids).to_bytes(4, "little"))
            h.update(np.asarray(ids, dtype=np.int64).tobytes())
        if isinstance(e, VisionPair):  # the same tokens over other images score otherwise: their sha256s
            h.update("|".join(e.vision["images"]).encode())
    return h.hexdigest()


class ReferenceCache:
    """The entries of one ``.npz`` file at ``path`` (which need not exist yet)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _entries(self, only: str | None = None) -> dict[str, np.ndarray]:
        """The file's entries (just ``only``'s, if given: the others are not read)."""
        if not self.path.exists():
            return {}
        try:
            with np.load(self.path, allow_pickle=False) as npz:
                return {name: npz[name] for name in npz.files if only in (None, name)}
        except (OSError, ValueError, zipfile.BadZipFile) as exc:  # truncated or foreign: start afresh
            log.warning("reference log-probs in %s not readable (%s); computing them again", self.path, exc)
            return {}

    def load(self, key: str, n_pairs: int) -> np.ndarray | None:
        """The [n_pairs, 2] log-probs stored under ``key``, or None."""
        values = self._entries(only=key).get(key)
        if values is None or values.shape != (n_pairs, 2):
            return None
        return values

    def save(self, key: str, values: np.ndarray) -> None:
        """Add (or refresh) ``key``; the oldest entries beyond ``MAX_ENTRIES`` go. Written to a temporary
        file and renamed, so a reader never sees half a file."""
        entries = {k: v for k, v in self._entries().items() if k != key}
        entries[key] = np.asarray(values, dtype=np.float64)
        kept = dict(list(entries.items())[-MAX_ENTRIES:])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".reference-", suffix=".npz")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, allow_pickle=False, **kept)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
