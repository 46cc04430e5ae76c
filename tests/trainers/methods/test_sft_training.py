"""SFT end to end on the tiny model: the loss falls, weights move, runs repeat, exports load without peft."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.trainers.helpers import Recorder
from trainers.families.entry import load_model_to_train
from trainers.methods.sft import SFTConfig, train_sft

STEP_KEYS = {
    "step",
    "epoch",
    "loss",
    "learning_rate",
    "grad_norm",
    "tokens_per_second",
    "mean_token_accuracy",
    "trained_tokens",
    "total_steps",
}


def assert_final_checkpoint_generates(path: Path, base: Path) -> None:
    model_dir = path / "model"
    assert not (model_dir / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of Peru?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    # the demo rows answer "The capital of Peru is Lima."; 20 steps teach the tiny model the opening
    # (measured, greedy: "The capital of of is is" full, "The capital of." LoRA), not yet the fact
    assert reply.startswith("The capital of"), reply
    before, after = load_file(base / "model.safetensors"), load_file(model_dir / "model.safetensors")
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed


@pytest.mark.parametrize(
    ("use_lora", "learning_rate"),
    [(False, 3e-3), (True, 1e-2)],
    ids=["full", "lora"],
)
def test_loss_falls_and_final_checkpoint_loads(
    make_config: Callable[..., SFTConfig],
    demo_rows: list[dict[str, Any]],
    tiny_model_path: Path,
    use_lora: bool,
    learning_rate: float,
) -> None:
    config = make_config(
        use_lora=use_lora, learning_rate=learning_rate, n_epochs=2, max_steps=20, save_steps=10
    )
    rec = Recorder()
    result = train_sft(config, demo_rows, demo_rows[:8], rec)

    assert rec.begin == {"total_steps": 20, "n_epochs": 2}
    assert [int(r["step"]) for r in rec.steps] == list(range(1, 21))
    assert all(set(r) == STEP_KEYS for r in rec.steps)
    first, last = sum(rec.losses[:3]) / 3, sum(rec.losses[-3:]) / 3
    assert last < first - 0.3, rec.losses
    assert rec.steps[-1]["mean_token_accuracy"] > rec.steps[0]["mean_token_accuracy"]
    assert rec.steps[-1]["trained_tokens"] > rec.steps[0]["trained_tokens"] > 0
    assert rec.steps[15]["epoch"] == pytest.approx(1.0)  # 64 rows / batch 4 = 16 steps an epoch
    assert rec.epochs == [(1, 16)]
    # Validation at the end of the epoch and after the last step.
    assert [int(r["step"]) for r in rec.evals] == [16, 20]
    assert set(rec.evals[0]) == {"step", "epoch", "valid_loss", "valid_mean_token_accuracy"}
    # Measured (seed 42): 4.43 -> 4.34 full, 5.665 -> 5.657 LoRA; the validation rows are training rows,
    # so they end well below the first step's loss (6.23) and still fall over the second epoch.
    assert rec.evals[-1]["valid_loss"] < rec.evals[0]["valid_loss"] < rec.losses[0] - 0.5

    assert [(c.step, c.final) for c in rec.checkpoints] == [(10, False), (20, True)]
    intermediate = rec.checkpoints[0].path / "model"
    assert (intermediate / "adapter_config.json").exists() == use_lora
    assert (rec.checkpoints[0].path / "state" / "optimizer.pt").exists()
    assert result.stopped is None and result.steps == 20
    assert result.final_checkpoint == rec.checkpoints[-1]
    assert result.metrics["valid_loss"] == rec.evals[-1]["valid_loss"]
    assert_final_checkpoint_generates(result.final_checkpoint.path, tiny_model_path)
    leftovers = [p.name for p in Path(config.output_dir).iterdir() if not p.name.startswith("checkpoint-")]
    assert leftovers == []


def test_same_seed_same_losses(
    make_config: Callable[..., SFTConfig], demo_rows: list[dict[str, Any]]
) -> None:
    def losses(seed: int, out: str) -> list[float]:
        rec = Recorder()
        train_sft(
            make_config(seed=seed, max_steps=4, lora_dropout=0.1, output_dir=out), demo_rows, callbacks=rec
        )
        return rec.losses

    base = str(Path(make_config().output_dir).parent)
    assert losses(1, f"{base}/a") == losses(1, f"{base}/b")
    assert losses(2, f"{base}/c") != losses(1, f"{base}/a")


def test_gradient_accumulation_matches_a_big_batch(
    make_config: Callable[..., SFTConfig], demo_rows: list[dict[str, Any]]
) -> None:
    """Per-token normalisation over the accumulated batch: 2 x 4 examples == 1 x 8 examples."""
    big, accumulated = Recorder(), Recorder()
    base = str(Path(make_config().output_dir).parent)
    train_sft(make_config(batch_size=8, max_steps=2, output_dir=f"{base}/big"), demo_rows, callbacks=big)
    config = make_config(batch_size=4, gradient_accumulation_steps=2, max_steps=2, output_dir=f"{base}/acc")
    train_sft(config, demo_rows, callbacks=accumulated)
    for a, b in zip(big.steps, accumulated.steps, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["trained_tokens"] == b["trained_tokens"]


def test_gradient_checkpointing_gives_the_same_losses(
    make_config: Callable[..., SFTConfig], demo_rows: list[dict[str, Any]]
) -> None:
    plain, checkpointed = Recorder(), Recorder()
    base = str(Path(make_config().output_dir).parent)
    train_sft(make_config(max_steps=3, output_dir=f"{base}/plain"), demo_rows, callbacks=plain)
    config = make_config(max_steps=3, gradient_checkpointing=True, output_dir=f"{base}/gc")
    train_sft(config, demo_rows, callbacks=checkpointed)
    assert checkpointed.losses == pytest.approx(plain.losses, abs=1e-5)


def test_bad_hyperparameter_is_a_data_error(
    make_config: Callable[..., SFTConfig], demo_rows: list[dict[str, Any]]
) -> None:
    from trainers.core.errors import DataError

    with pytest.raises(DataError) as info:
        train_sft(make_config(lr_scheduler="step"), demo_rows)
    assert info.value.param == "hyperparameters.lr_scheduler"


def test_eval_steps_and_data_errors(
    make_config: Callable[..., SFTConfig], demo_rows: list[dict[str, Any]]
) -> None:
    rec = Recorder()
    train_sft(make_config(max_steps=5, eval_steps=2), demo_rows, demo_rows[:4], rec)
    assert [int(r["step"]) for r in rec.evals] == [2, 4, 5]

    from trainers.core.errors import DataError

    with pytest.raises(DataError) as info:
        train_sft(make_config(max_length=6), demo_rows)
    assert info.value.param == "hyperparameters.max_length"
    with pytest.raises(DataError) as info:
        train_sft(make_config(), demo_rows, [{"text": 1}])
    assert info.value.param == "validation_file"


def test_gradient_checkpointing_is_enabled(
    tiny_model_path: Path, make_config: Callable[..., SFTConfig]
) -> None:
    from peft import PeftModel

    for use_lora in (True, False):
        model = load_model_to_train(
            make_config(use_lora=use_lora, gradient_checkpointing=True), torch.device("cpu")
        )
        base = model.get_base_model() if isinstance(model, PeftModel) else model
        assert base.is_activation_checkpointing and not base.config.use_cache
