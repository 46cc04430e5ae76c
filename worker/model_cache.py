"""Loaded models kept in memory between inference requests, least recently used dropped first.

The budget counts the bytes of every parameter and buffer (what a model really holds, whatever its
files' format or quantization). A model is measured once loaded, and older ones are dropped until it
fits; a model larger than the whole budget is still served, alone. The cache belongs to one inference
worker process (one request at a time), so it needs no lock.
"""

from __future__ import annotations

import gc
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("tunehouse.inference")


@dataclass
class LoadedModel:
    model: Any  # a transformers causal LM, or a peft model around one
    tokenizer: Any
    nbytes: int
    processor: Any = None  # a vision-language model's (trainers.modeling.vision)


def model_bytes(model: Any) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return int(sum(t.numel() * t.element_size() for t in tensors))


class ModelCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[str, LoadedModel] = OrderedDict()

    @property
    def used_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def get(self, key: str, load: Callable[[], LoadedModel]) -> LoadedModel:
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        loaded = load()
        while self.entries and self.used_bytes + loaded.nbytes > self.budget_bytes:
            dropped, entry = self.entries.popitem(last=False)
            log.info("model cache: dropped %s (%.1f MB) to fit %s", dropped, entry.nbytes / 2**20, key)
            del entry
        gc.collect()  # the dropped models' tensors are freed now, not at some later collection
        self.entries[key] = loaded
        return loaded
