"""Checkpoints (trainers/core/checkpoint.py) written and read directly: what a resumable checkpoint holds and
gives back, how a step's folder is replaced, which folders count, and what is refused.

The loop-level guarantees (a resumed run repeats the uninterrupted one) are
tests/trainers/core/test_resume.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from trainers.core.checkpoint import (
    CheckpointError,
    LoopState,
    checkpoint_dir,
    latest_checkpoint,
    load_loop_state,
    load_task_state,
    prune_checkpoints,
    restore_training_state,
    resumable_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from trainers.core.schedule import build_scheduler


class Secret:
    """Not a tensor: a state file holding one must not be unpickled (it could run code)."""


def _model(tiny_model_path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model_path)


def _training(model: Any) -> tuple[torch.optim.Optimizer, Any, torch.amp.GradScaler]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = build_scheduler(optimizer, kind="linear", warmup_steps=2, total_steps=10)
    return optimizer, scheduler, torch.amp.GradScaler("cpu", init_scale=1024.0)


def _resumable(tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase, out: Path, *, step: int) -> Any:
    """A resumable checkpoint of the tiny model at `step`: an optimizer state, nothing else optional."""
    model = _model(tiny_model_path)
    optimizer, _, _ = _training(model)
    return save_checkpoint(
        out,
        model=model,
        tokenizer=tokenizer,
        state=LoopState(step=step),
        epoch=1.0,
        final=False,
        optimizer=optimizer,
    )


def test_a_checkpoint_gives_back_everything_it_was_given(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    model = _model(tiny_model_path)
    optimizer, scheduler, scaler = _training(model)
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    scheduler.step()
    state = LoopState(
        step=7, epoch=1, batch_index=2, trained_tokens=99, permutation=[1, 0], metrics={"loss": 2.5}
    )
    task = {"head": torch.arange(3.0)}
    info = save_checkpoint(
        tmp_path,
        model=model,
        tokenizer=tokenizer,
        state=state,
        epoch=1.5,
        final=False,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        task_state=task,
    )
    assert (info.path, info.step, info.epoch, info.final, info.metrics) == (
        checkpoint_dir(tmp_path, 7),
        7,
        1.5,
        False,
        {"loss": 2.5},
    )
    assert info.path.name == "checkpoint-000007"
    verify_checkpoint(info.path)
    assert torch.equal(load_task_state(info.path)["head"], task["head"])  # type: ignore[index]

    fresh = _model(tiny_model_path)
    optimizer2, scheduler2, _ = _training(fresh)
    scaler2 = torch.amp.GradScaler("cpu")  # default scale 65536
    assert (
        restore_training_state(info.path, optimizer=optimizer2, scheduler=scheduler2, scaler=scaler2) == state
    )
    assert scaler2.get_scale() == 1024.0
    assert scheduler2.state_dict()["last_epoch"] == 1
    assert optimizer2.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000007"]  # no temporary folder left


def test_a_checkpoint_without_a_task_state_has_none(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    info = _resumable(tiny_model_path, tokenizer, tmp_path, step=1)
    assert load_task_state(info.path) is None
    assert not (info.path / "state" / "scaler.pt").exists()


def test_saving_a_step_again_replaces_its_folder(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    """A pause checkpoint at step 3, then the final one at step 3: the folder is the final one, whole."""
    model = _model(tiny_model_path)
    model.config.use_cache = False  # as gradient checkpointing leaves it
    optimizer, _, _ = _training(model)
    kwargs: dict[str, Any] = {
        "model": model,
        "tokenizer": tokenizer,
        "state": LoopState(step=3),
        "epoch": 1.0,
    }
    save_checkpoint(tmp_path, final=False, optimizer=optimizer, **kwargs)
    assert resumable_checkpoints(tmp_path) == [checkpoint_dir(tmp_path, 3)]
    info = save_checkpoint(tmp_path, final=True, **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000003"]  # no .old-* or .tmp-* left
    assert not (info.path / "state").exists() and resumable_checkpoints(tmp_path) == []
    config = json.loads((info.path / "model" / "config.json").read_text(encoding="utf-8"))
    assert config["use_cache"] is True  # an export is for inference: the KV cache back on
    assert AutoModelForCausalLM.from_pretrained(info.path / "model") is not None


def _fake(out: Path, name: str, *, state: bool = True) -> Path:
    folder = out / name
    (folder / "state" if state else folder).mkdir(parents=True)
    return folder


def test_only_step_folders_with_a_state_are_resumable_newest_first(tmp_path: Path) -> None:
    big, small, mid = (
        _fake(tmp_path, n) for n in ("checkpoint-1000000", "checkpoint-000002", "checkpoint-999999")
    )
    _fake(tmp_path, "checkpoint-000005", state=False)  # a final export
    _fake(tmp_path, "checkpoint-latest")  # not a step
    _fake(tmp_path, "other-000009")
    # by step, not by name: "checkpoint-999999" sorts after "checkpoint-1000000" as text
    assert resumable_checkpoints(tmp_path) == [big, mid, small]
    assert resumable_checkpoints(tmp_path / "nothing-here") == []


def test_pruning_keeps_the_newest_and_at_least_one(tmp_path: Path) -> None:
    folders = [_fake(tmp_path, f"checkpoint-{s:06d}") for s in (1, 2, 3)]
    export = _fake(tmp_path, "checkpoint-000004", state=False)
    assert prune_checkpoints(tmp_path, keep=2) == [folders[0]]
    assert prune_checkpoints(tmp_path, keep=0) == [folders[1]]  # 0 still keeps the newest
    assert prune_checkpoints(tmp_path, keep=1) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [folders[2].name, export.name]


def test_a_damaged_or_foreign_checkpoint_is_refused_by_name(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    info = _resumable(tiny_model_path, tokenizer, tmp_path, step=2)
    manifest_path = info.path / "state" / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    rng = info.path / "state" / "rng.pt"
    size = manifest["files"]["state/rng.pt"]
    rng.rename(rng.with_suffix(".gone"))
    with pytest.raises(
        CheckpointError, match=rf"^{info.path}: state/rng.pt is missing, expected {size} bytes$"
    ):
        verify_checkpoint(info.path)
    assert latest_checkpoint(tmp_path) is None
    rng.with_suffix(".gone").rename(rng)
    manifest_path.write_text(json.dumps({**manifest, "format_version": 99}), encoding="utf-8")
    with pytest.raises(CheckpointError, match=rf"^{info.path}: unsupported checkpoint format$"):
        verify_checkpoint(info.path)
    # a trainer_state.json from another format, under a valid manifest
    manifest_path.write_text(json.dumps(manifest), encoding="utf-8")
    state_path = info.path / "state" / "trainer_state.json"
    payload = json.loads(state_path.read_text(encoding="utf-8"))
    del payload["format_version"]
    text = json.dumps(payload)
    state_path.write_text(text, encoding="utf-8")
    manifest["files"]["state/trainer_state.json"] = len(text.encode())
    manifest_path.write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(CheckpointError, match=rf"^{info.path}: unsupported checkpoint format$"):
        load_loop_state(info.path)


def test_a_state_file_holding_objects_is_not_unpickled(tmp_path: Path) -> None:
    folder = _fake(tmp_path, "checkpoint-000001")
    torch.save({"head": Secret()}, folder / "state" / "task.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        load_task_state(folder)


def test_a_failed_save_leaves_nothing_behind_and_says_why(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(tiny_model_path)
    out = tmp_path / "runs" / "job"  # its parents do not exist yet

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tokenizer, "save_pretrained", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        save_checkpoint(out, model=model, tokenizer=tokenizer, state=LoopState(step=1), epoch=0.5, final=True)
    assert list(out.iterdir()) == []  # no half-written checkpoint, no temporary folder


def test_a_scaler_state_is_optional_on_both_sides(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    """fp16 runs save a GradScaler state; resuming without a scaler ignores it, and a scaler resumed from
    a checkpoint without one keeps its own."""
    model = _model(tiny_model_path)
    optimizer, _, scaler = _training(model)
    kwargs: dict[str, Any] = {"model": model, "tokenizer": tokenizer, "epoch": 1.0, "final": False}
    with_scaler = save_checkpoint(
        tmp_path, state=LoopState(step=1), optimizer=optimizer, scaler=scaler, **kwargs
    )
    without = save_checkpoint(tmp_path, state=LoopState(step=2), optimizer=optimizer, **kwargs)
    assert restore_training_state(with_scaler.path, optimizer=_training(model)[0]).step == 1
    fresh = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert restore_training_state(without.path, optimizer=_training(model)[0], scaler=fresh).step == 2
    assert fresh.get_scale() == 8.0
