"""Several LoRA jobs on one copy of the base (trainers/families/shared_base.py): each computes what it
computes alone, its files are a lone job's files, and the base is left as it was loaded."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.trainers.helpers import Recorder
from tests.trainers.methods.test_dpo import separable_rows
from tests.trainers.methods.test_grpo import HAS_E_SET
from tests.trainers.methods.test_grpo import ROWS as GRPO_ROWS
from trainers.core import turns
from trainers.core.callbacks import TrainResult
from trainers.families.shared_base import SharedBase, seat_of_this_thread
from trainers.methods.dpo import DPOConfig, train_dpo
from trainers.methods.grpo import GRPOConfig, train_grpo
from trainers.methods.reward_model import RewardModelConfig, train_reward_model
from trainers.methods.sft import SFTConfig, train_sft

# Interleaving whole steps runs each job's operations in its own order on the same weights, with its own
# random state restored at each turn: the same numbers as alone. What may differ is only CPU kernels'
# thread scheduling (deterministic here), so the tolerance is float32's rounding of a loss, not a
# training-noise margin: a job that saw another's adapter, data order or dropout mask moves by > 1e-3.
REL = 1e-6

Run = Callable[[], TrainResult]


def _sft(tiny: Path, out: Path, rows: list[dict[str, Any]], name: str, **hp: Any) -> Callable[[], Run]:
    """A LoRA SFT job of one epoch whose recorder is ``runs[name]`` once made."""

    def make() -> Run:
        config = SFTConfig(model_path=str(tiny), output_dir=str(out / name), use_lora=True, n_epochs=1, **hp)
        recorder = Recorder()
        runs[name] = recorder
        return lambda: train_sft(config, rows, callbacks=recorder)

    return make


def _dpo(tiny: Path, out: Path, name: str, **hp: Any) -> Callable[[], Run]:
    """A LoRA DPO job of one epoch on separable pairs, batches of 4, recorded as ``runs[name]``."""

    def make() -> Run:
        config = DPOConfig(
            model_path=str(tiny), output_dir=str(out / name), use_lora=True, n_epochs=1, batch_size=4, **hp
        )
        recorder = Recorder()
        runs[name] = recorder
        return lambda: train_dpo(config, separable_rows(16), callbacks=recorder)

    return make


class SeatNoting(Recorder):
    """Notes at each step whether the step ran on a shared base under this job's adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.on_shared_base: list[bool] = []

    def on_step(self, row: dict[str, float]) -> None:
        super().on_step(row)
        seat = seat_of_this_thread()
        model = seat[0]._model if seat is not None else None
        self.on_shared_base.append(model is not None and model.active_adapter == seat[1])  # type: ignore[index]


def _rm(tiny: Path, out: Path, name: str, **hp: Any) -> Callable[[], Run]:
    """A LoRA reward-model job of 6 steps with dropout, a checkpoint at step 3 and a validation set,
    recorded as ``runs[name]``."""

    def make() -> Run:
        config = RewardModelConfig(
            model_path=str(tiny),
            output_dir=str(out / name),
            use_lora=True,
            batch_size=2,
            max_steps=6,
            save_steps=3,
            eval_steps=3,
            learning_rate=1e-2,
            lora_dropout=0.1,
            **hp,
        )
        recorder = SeatNoting()
        runs[name] = recorder
        return lambda: train_reward_model(config, separable_rows(16), separable_rows(4), callbacks=recorder)

    return make


def _jobs(tiny: Path, tmp: Path, rows: list[dict[str, Any]]) -> dict[str, Callable[[], Run]]:
    def grpo(name: str) -> Callable[[], Run]:
        def make() -> Run:
            config = GRPOConfig(
                model_path=str(tiny),
                output_dir=str(tmp / name),
                use_lora=True,
                batch_size=4,
                num_generations=4,
                max_completion_length=4,
                max_steps=4,
                beta=0.05,  # the KL to the reference: the base with the adapter disabled
                learning_rate=1e-2,
                lora_dropout=0.1,
            )
            recorder = Recorder()
            runs[name] = recorder
            return lambda: train_grpo(config, GRPO_ROWS, callbacks=recorder, rewards=HAS_E_SET)

        return make

    runs.clear()
    return {
        # dropout draws from the global generator: each job must draw from its own
        "sft-a": _sft(tiny, tmp, rows, "sft-a", seed=1, learning_rate=1e-3, batch_size=4, lora_dropout=0.1),
        "sft-b": _sft(tiny, tmp, rows, "sft-b", seed=2, learning_rate=5e-3, batch_size=8, lora_r=4),
        "dpo": _dpo(tiny, tmp, "dpo"),
        # sampling draws from the global generator too, and samples through merged adapter weights
        "grpo": grpo("grpo"),
    }


runs: dict[str, Recorder] = {}


def _losses(recorder: Recorder) -> list[float]:
    return [row["loss"] for row in recorder.steps]


def _final_weights(recorder: Recorder) -> dict[str, torch.Tensor]:
    final = recorder.checkpoints[-1]
    assert final.final
    return load_file(final.path / "model" / "model.safetensors")


def _run_together(jobs: dict[str, Run]) -> SharedBase:
    """Each job in a thread of its own, seated on one shared base; fails with any job's error."""
    base = SharedBase()
    errors: list[BaseException] = []

    def run_on(name: str, job: Run) -> None:
        try:
            with base.seat(name):
                job()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run_on, args=(name, job)) for name, job in jobs.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    return base


def test_jobs_on_a_shared_base_train_as_they_do_alone(
    tiny_model_path: Path, demo_rows: list[dict[str, Any]], tmp_path: Path
) -> None:
    alone: dict[str, Recorder] = {}
    for name, make in _jobs(tiny_model_path, tmp_path / "alone", demo_rows).items():
        make()()
        alone[name] = runs[name]

    shared = _jobs(tiny_model_path, tmp_path / "shared", demo_rows)
    base = _run_together({name: make() for name, make in shared.items()})
    for name, solo in alone.items():
        assert len(solo.steps) >= 4
        assert _losses(runs[name]) == pytest.approx(_losses(solo), rel=REL), name
        # the download: the adapter merged into a copy of the base, the same weights as a lone job's
        shared, own = _final_weights(runs[name]), _final_weights(solo)
        assert shared.keys() == own.keys()
        for key, value in own.items():
            assert torch.allclose(shared[key], value, rtol=REL, atol=1e-7), (name, key)
    assert base.jobs == []


def test_the_jobs_interleave_and_leave_the_base_as_loaded(
    tiny_model_path: Path, demo_rows: list[dict[str, Any]], tmp_path: Path
) -> None:
    """Turns alternate step by step (neither job waits for the other's end), the adapters hold the base
    once, and after exporting both the base's weights are still the loaded ones."""
    base = SharedBase()
    order: list[str] = []
    seen: dict[str, torch.nn.Module] = {}

    class Noting(Recorder):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def on_step(self, row: dict[str, float]) -> None:
            order.append(self.name)
            seen[self.name] = base._model  # type: ignore[assignment]  # the model object it trains
            super().on_step(row)

    def job(name: str) -> None:
        config = SFTConfig(
            model_path=str(tiny_model_path),
            output_dir=str(tmp_path / name),
            use_lora=True,
            n_epochs=1,
            batch_size=4,
        )
        with base.seat(name):
            train_sft(config, demo_rows, callbacks=Noting(name))
            assert base._model is not None
            loaded = AutoModelForCausalLM.from_pretrained(tiny_model_path)
            own = base._model.get_base_model().state_dict()
            for key, value in loaded.state_dict().items():
                held = own.get(key, own.get(key.rsplit(".", 1)[0] + ".base_layer." + key.rsplit(".", 1)[1]))
                assert held is not None and torch.equal(held, value), key

    threads = [threading.Thread(target=job, args=(name,)) for name in ("x", "y")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert seen["x"] is seen["y"]  # one model object
    firsts = {name: order.index(name) for name in ("x", "y")}
    lasts = {name: len(order) - 1 - order[::-1].index(name) for name in ("x", "y")}
    assert max(firsts.values()) < min(lasts.values()), order  # each started before the other ended
    switches = sum(1 for a, b in itertools.pairwise(order) if a != b)
    assert switches >= len(order) - 2, order  # step by step, in turn


def test_a_shared_base_refuses_a_job_that_needs_its_own(tiny_model_path: Path, tmp_path: Path) -> None:
    base = SharedBase()
    config = DPOConfig(model_path=str(tiny_model_path), output_dir=str(tmp_path), use_lora=False)
    with pytest.raises(ValueError, match="LoRA"):
        base.attach("full", config, torch.device("cpu"))


def test_a_job_uploading_lets_the_others_step(
    tiny_model_path: Path, demo_rows: list[dict[str, Any]], tmp_path: Path
) -> None:
    """What a job does ``turns.away()`` from the model (a checkpoint's upload) runs while the jobs beside
    it train; the job then goes on with its own adapter and mode. Without ``away`` the other job could
    not step until the upload ended: the wait below would time out."""
    base = SharedBase()
    other_stepped = threading.Event()
    during_upload: list[bool] = []
    errors: list[BaseException] = []

    class Uploading(Recorder):
        def on_checkpoint(self, ckpt: Any) -> None:
            super().on_checkpoint(ckpt)
            if not ckpt.final:
                return
            other_stepped.clear()
            with turns.away():
                during_upload.append(other_stepped.wait(timeout=30))
            assert base._model is not None and base._model.active_adapter == "uploader"

    class Stepping(Recorder):
        def on_step(self, row: dict[str, float]) -> None:
            super().on_step(row)
            other_stepped.set()

    def job(name: str, callbacks: Recorder, epochs: int) -> None:
        config = SFTConfig(
            model_path=str(tiny_model_path),
            output_dir=str(tmp_path / name),
            use_lora=True,
            n_epochs=epochs,
            batch_size=4,
        )
        try:
            with base.seat(name):
                train_sft(config, demo_rows, callbacks=callbacks)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=job, args=("uploader", Uploading(), 1)),
        threading.Thread(target=job, args=("trainer", Stepping(), 3)),  # still training at the upload
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    assert during_upload == [True]


def test_qlora_jobs_share_one_quantized_base(
    tiny_model_path: Path, demo_rows: list[dict[str, Any]], tmp_path: Path
) -> None:
    """Two QLoRA jobs (an SFT, a DPO whose reference is the quantized base with its adapter disabled) on
    one 4-bit base: losses as alone, and each download is its adapter merged into the *dequantized*
    base, as a lone QLoRA job's is (trainers/core/checkpoint.py), the base staying quantized for the
    other job. Same tolerance as above: the quantized products are deterministic."""

    def make(folder: str) -> dict[str, Callable[[], Run]]:
        out = tmp_path / folder
        return {
            "sft": _sft(
                tiny_model_path, out, demo_rows, "sft", quantization="nf4", batch_size=4, learning_rate=1e-2
            ),
            "dpo": _dpo(tiny_model_path, out, "dpo", quantization="nf4", seed=3),
        }

    alone: dict[str, Recorder] = {}
    for name, job in make("alone").items():
        job()()
        alone[name] = runs[name]
    _run_together({name: job() for name, job in make("shared").items()})
    for name, solo in alone.items():
        assert len(solo.steps) >= 4
        assert _losses(runs[name]) == pytest.approx(_losses(solo), rel=REL), name
        shared, own = _final_weights(runs[name]), _final_weights(solo)
        assert shared.keys() == own.keys(), name  # plain weights: no quantization state
        for key, value in own.items():
            assert shared[key].dtype == value.dtype, (name, key)
            assert torch.allclose(shared[key], value, rtol=REL, atol=1e-7), (name, key)
        config = json.loads((runs[name].checkpoints[-1].path / "model" / "config.json").read_text())
        assert "quantization_config" not in config


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path)


def _same_tensors(shared: dict[str, torch.Tensor], own: dict[str, torch.Tensor], what: str) -> None:
    assert shared.keys() == own.keys(), what
    for key, value in own.items():
        assert shared[key].dtype == value.dtype, (what, key)
        assert torch.allclose(shared[key], value, rtol=REL, atol=1e-7), (what, key)


def test_reward_models_share_the_base_and_train_as_they_do_alone(
    tiny_model_path: Path, demo_rows: list[dict[str, Any]], tmp_path: Path
) -> None:
    """A reward model on a shared base is the causal LM's decoder under its adapter and a head of its
    own (trainers/modeling/adapter_classifier.py): two of them beside an SFT job (one loads the base or
    joins it, the other joins) compute the lone classifier's losses and validation, and write a lone
    reward model's files: its checkpoint's adapter and head, and a plain sequence-classifier export."""

    def make(folder: str) -> dict[str, Callable[[], Run]]:
        out = tmp_path / folder
        return {
            "rm-a": _rm(tiny_model_path, out, "rm-a", seed=5),
            "rm-b": _rm(tiny_model_path, out, "rm-b", seed=6, lora_r=4),
            "sft": _sft(tiny_model_path, out, demo_rows, "sft", batch_size=4),
        }

    alone: dict[str, Recorder] = {}
    for name, job in make("alone").items():
        job()()
        alone[name] = runs[name]
    _run_together({name: job() for name, job in make("shared").items()})
    for name in ("rm-a", "rm-b"):
        solo, shared = alone[name], runs[name]
        assert len(solo.steps) == 6
        assert isinstance(shared, SeatNoting) and shared.on_shared_base == [True] * 6
        for key in ("loss", "accuracy", "rewards/margins"):
            assert [r[key] for r in shared.steps] == pytest.approx([r[key] for r in solo.steps], rel=REL)
        assert [r["valid_loss"] for r in shared.evals] == pytest.approx(
            [r["valid_loss"] for r in solo.evals], rel=REL
        )
        mid, own_mid = shared.checkpoints[0].path / "model", solo.checkpoints[0].path / "model"
        _same_tensors(
            _tensors(mid / "adapter_model.safetensors"), _tensors(own_mid / "adapter_model.safetensors"), name
        )
        adapter = json.loads((mid / "adapter_config.json").read_text())
        assert adapter["task_type"] == "SEQ_CLS" and "score" in adapter["modules_to_save"]
        final = shared.checkpoints[-1]
        assert final.final
        _same_tensors(_final_weights(shared), _final_weights(solo), name)
        config = json.loads((final.path / "model" / "config.json").read_text())
        own = json.loads((solo.checkpoints[-1].path / "model" / "config.json").read_text())
        for key in ("architectures", "id2label", "pad_token_id", "dtype", "use_cache"):
            assert config.get(key) == own.get(key), (name, key)
    assert _losses(runs["sft"]) == pytest.approx(_losses(alone["sft"]), rel=REL)


def test_a_reward_model_resumes_on_a_shared_base(
    tiny_model_path: Path, demo_rows: list[dict[str, Any]], tmp_path: Path
) -> None:
    """A reward model's checkpoint resumed on a shared base (its adapter and its head, restored beside
    another job's adapter) repeats the uninterrupted run's steps."""
    _rm(tiny_model_path, tmp_path / "full", "full", seed=5)()()
    full = runs["full"]
    mid = str(full.checkpoints[0].path)
    jobs = {
        "sft": _sft(tiny_model_path, tmp_path, demo_rows, "sft", batch_size=4)(),
        "rm": _rm(tiny_model_path, tmp_path / "resumed", "rm", seed=5, resume_from=mid)(),
    }
    _run_together(jobs)
    assert [int(r["step"]) for r in runs["rm"].steps] == [4, 5, 6]
    assert runs["rm"].on_shared_base == [True] * 3  # type: ignore[attr-defined]
    assert _losses(runs["rm"]) == pytest.approx(_losses(full)[3:], rel=REL)
