"""The measured side of the memory model's tests (tests/trainers/test_memory_model.py and
bench/memory_estimate.py): the peak bytes of live tensors during SFT steps, as ``trainers.memory_model``
estimates them.

How: torch's CPU allocator keeps no statistics (``torch.cuda.max_memory_allocated`` has no CPU twin) and
a process's RSS moves with the allocator's caching and the interpreter (tens of MiB of noise against a
tiny model's few MiB). So every tensor an operation returns is counted through a ``TorchDispatchMode``
while its storage lives (a weak reference per tensor; views share their storage's count): the sum of
live storages, at its maximum, is the step's peak, the number a GPU's allocator would report (less its
rounding). The model's weights and buffers exist before the mode starts and are added as they are.
"""

from __future__ import annotations

import random
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainers.data.collate import SFTBatch, pack_batch, pad_batch
from trainers.data.sft import tokenize_sft_rows
from trainers.families.entry import load_model_to_train
from trainers.methods.sft import SFTConfig, sft_loss
from trainers.modeling.loading import load_tokenizer, runs_packed
from trainers.modeling.tiny_model import CORPUS_PATH


class LiveTensorPeak(TorchDispatchMode):
    """The maximum of the bytes held by the storages of live tensors made while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [live tensors, bytes]
        self.current = 0
        self.peak = 0

    def _release(self, address: int) -> None:
        entry = self.live[address]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[address]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            address = storage.data_ptr()
            if address == 0:
                continue
            if address in self.live:
                self.live[address][0] += 1
            else:
                self.live[address] = [1, storage.nbytes()]
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
            weakref.finalize(t, self._release, address)
        return out


@dataclass(frozen=True)
class Measured:
    peak_bytes: int
    tokens: int  # rows x padded width of the micro-batch
    targets: int
    padded: bool  # some row is shorter than the widest


def synthetic_rows(n: int, words: int, seed: int = 0) -> list[dict[str, str]]:
    """`n` prompt/completion rows of about `words` words of the tiny corpus each."""
    rng = random.Random(seed)
    vocab = CORPUS_PATH.read_text(encoding="utf-8").split()
    text = lambda k: " ".join(rng.choice(vocab) for _ in range(k))  # noqa: E731
    return [{"prompt": text(words // 4), "completion": " " + text(words - words // 4)} for _ in range(n)]


def measure_sft_peak(model_path: Path | str, rows: list[dict[str, Any]], **config: Any) -> Measured:
    """Peak live-tensor bytes over two SFT steps (the second has the optimizer's state) on one
    micro-batch of `rows`, through the trainer's own loading, kernels, collation and loss."""
    settings = SFTConfig(str(model_path), "/nonexistent", **config)
    tokenizer = load_tokenizer(str(model_path))
    pad_id = tokenizer.pad_token_id
    assert isinstance(pad_id, int)
    examples = list(tokenize_sft_rows(rows, tokenizer, max_length=settings.max_length))
    torch.manual_seed(0)
    model = load_model_to_train(settings, torch.device("cpu"))
    model.train()  # as the loop does: transformers checkpoints layers only in training mode
    batch: SFTBatch = (
        pack_batch(examples, pad_token_id=pad_id, max_length=None)
        if runs_packed(model)
        else pad_batch(examples, pad_token_id=pad_id)
    )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    peak = LiveTensorPeak()
    with peak:
        for _ in range(2):
            out = sft_loss(model, batch)
            (out.loss / batch.n_targets).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    lengths = {len(e.input_ids) for e in examples}
    return Measured(
        sum(held.values()) + peak.peak, len(examples) * max(lengths), batch.n_targets, len(lengths) > 1
    )
