"""Learning-rate schedules match transformers' curves."""

from __future__ import annotations

import pytest
import torch
from transformers import get_scheduler

from trainers.core.schedule import build_scheduler


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant"])
def test_schedule_matches_transformers(kind: str) -> None:
    def lrs(make: object) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = make(optimizer)  # type: ignore[operator]
        out = []
        for _ in range(10):
            out.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return out

    ours = lrs(lambda opt: build_scheduler(opt, kind=kind, warmup_steps=3, total_steps=10))
    hf_kind = "constant_with_warmup" if kind == "constant" else kind
    theirs = lrs(lambda opt: get_scheduler(hf_kind, opt, num_warmup_steps=3, num_training_steps=10))
    assert ours == pytest.approx(theirs, abs=1e-12)
