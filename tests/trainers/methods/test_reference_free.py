"""ORPO, CPO and SimPO: losses equal TRL's (``trl.experimental.orpo``/``cpo``) on the same model and batch,
the odds ratio and SimPO's margin by hand, the model learns a separable preference, and a resumed run
repeats the uninterrupted one."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase
from trl.import_utils import TRLExperimentalWarning

from tests.trainers.helpers import RESUME_RUN, Recorder
from tests.trainers.methods.test_dpo import STRING_ROWS, separable_rows
from trainers.core.errors import DataError
from trainers.core.loop import LossSums
from trainers.data.preference import PreferenceExample, collate_preferences, tokenize_preference_rows
from trainers.losses.preference import cpo_loss, kto_loss, log1mexp, odds_ratio_loss
from trainers.methods.cpo import CPOConfig, CPOLoss, SimPOConfig, train_cpo, train_simpo
from trainers.methods.orpo import ORPOConfig, ORPOLoss, train_orpo

with warnings.catch_warnings():  # TRL warns, once, that its experimental trainers may change
    warnings.simplefilter("ignore", TRLExperimentalWarning)
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

METHODS: dict[str, tuple[type[Any], Callable[..., Any]]] = {
    "orpo": (ORPOConfig, train_orpo),
    "cpo": (CPOConfig, train_cpo),
    "simpo": (SimPOConfig, train_simpo),
}


def make(method: str, tiny_model_path: Path, output_dir: Path, **fields: Any) -> Any:
    config_cls, _ = METHODS[method]
    return config_cls(model_path=str(tiny_model_path), output_dir=str(output_dir), **fields)


def train(method: str, config: Any, *args: Any) -> Any:
    return METHODS[method][1](config, *args)


# -- losses vs TRL ------------------------------------------------------------------------------------


def trl_batch(examples: list[PreferenceExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """The pairs in TRL's ORPO/CPO batch layout: prompt + completion rows, prompt labels masked."""

    def pad(rows: list[list[int]], value: int) -> torch.Tensor:
        width = max(len(r) for r in rows)
        return torch.tensor([r + [value] * (width - len(r)) for r in rows])

    batch = {}
    for name in ("chosen", "rejected"):
        completions = [e.chosen_ids if name == "chosen" else e.rejected_ids for e in examples]
        ids = [e.prompt_ids + c for e, c in zip(examples, completions, strict=True)]
        batch[f"{name}_input_ids"] = pad(ids, pad_token_id)
        batch[f"{name}_attention_mask"] = pad([[1] * len(r) for r in ids], 0)
        labels = [[-100] * len(e.prompt_ids) + c for e, c in zip(examples, completions, strict=True)]
        batch[f"{name}_labels"] = pad(labels, -100)
    return batch


def trl_loss(method: str, model: torch.nn.Module, batch: dict[str, torch.Tensor], **hp: Any) -> Any:
    """TRL 1.16's ``get_batch_loss_metrics`` of its ORPO or CPO trainer: its own forward and loss code on
    a trainer object that holds only the attributes that code reads."""
    trainer_cls = ORPOTrainer if method == "orpo" else CPOTrainer
    trainer = trainer_cls.__new__(trainer_cls)
    trainer.__dict__.update(
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x),
        is_encoder_decoder=False,
        aux_loss_enabled=False,
        label_pad_token_id=-100,
        padding_value=0,
        pad_token_id=0,
        alpha=0.0,  # AlphaPO's reward shape off: CPO's and SimPO's log-prob rewards
        **hp,
    )
    return trainer.get_batch_loss_metrics(model, batch)


PARITY = [
    ("orpo", {"beta": 0.3}),
    ("cpo", {"beta": 0.3, "loss_type": "sigmoid", "cpo_alpha": 1.0, "label_smoothing": 0.1}),
    ("cpo", {"beta": 0.3, "loss_type": "hinge", "cpo_alpha": 0.5}),
    ("cpo", {"beta": 0.3, "loss_type": "ipo", "cpo_alpha": 1.0}),
    ("simpo", {"beta": 2.0, "loss_type": "simpo", "simpo_gamma": 1.2, "cpo_alpha": 0.0}),
    (
        "simpo",
        {"beta": 2.0, "loss_type": "simpo", "simpo_gamma": 0.6, "cpo_alpha": 0.3, "label_smoothing": 0.2},
    ),
]


@pytest.mark.parametrize(("method", "hp"), PARITY, ids=[f"{m}-{i}" for i, (m, _) in enumerate(PARITY)])
def test_loss_equals_trl(
    method: str, hp: dict[str, Any], tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():  # random weights: log-probs far from uniform, margins of both signs
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    examples = [
        *tokenize_preference_rows(STRING_ROWS, tokenizer, max_length=64),
        *tokenize_preference_rows(separable_rows(3), tokenizer, max_length=64),
    ]
    pad_id = tokenizer.pad_token_id
    assert isinstance(pad_id, int) and pad_id == 0  # TRL's padding value above
    theirs, metrics = trl_loss(method, model, trl_batch(examples, pad_id), **{"label_smoothing": 0.0} | hp)
    if method == "orpo":
        loss_fn: Callable[[torch.nn.Module, Any], LossSums] = ORPOLoss(hp["beta"])
    else:
        loss_fn = CPOLoss(
            hp["beta"],
            hp["loss_type"],
            hp["cpo_alpha"],
            hp.get("simpo_gamma", 0.0),
            hp.get("label_smoothing", 0.0),
        )
    ours = loss_fn(model, collate_preferences(examples, pad_token_id=pad_id))
    n = len(examples)
    assert ours.loss.item() / n == pytest.approx(theirs.item(), abs=1e-5)
    keys = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"]
    keys += ["log_odds_ratio", "log_odds_chosen"] if method == "orpo" else []
    keys += ["nll_loss"] if method == "orpo" or hp["cpo_alpha"] > 0 else []  # TRL logs 0 when α = 0
    for key in keys:
        assert ours.metrics[key] / n == pytest.approx(metrics[key], abs=1e-5), key
    assert 0 < metrics["rewards/accuracies"] < 1  # both orders occur: the comparison is not one-sided


def test_losses_by_hand() -> None:
    """ORPO's odds ratio and SimPO's margin on one pair, written out."""
    chosen, rejected = math.log(0.5), math.log(0.2)  # mean per-token probabilities 0.5 and 0.2
    losses, _, _, log_odds = odds_ratio_loss(torch.tensor([chosen]), torch.tensor([rejected]), beta=0.5)
    odds_ratio = (0.5 / 0.5) / (0.2 / 0.8)
    assert log_odds.item() == pytest.approx(math.log(odds_ratio), abs=1e-6)
    assert losses.item() == pytest.approx(-0.5 * math.log(odds_ratio / (1 + odds_ratio)), abs=1e-6)
    simpo, chosen_rewards, _ = cpo_loss(
        torch.tensor([-1.0]), torch.tensor([-1.5]), beta=2.0, loss_type="simpo", simpo_gamma=0.4
    )
    assert simpo.item() == pytest.approx(math.log1p(math.exp(-(2.0 * 0.5 - 0.4))), abs=1e-6)
    assert chosen_rewards.item() == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="loss_type"):
        cpo_loss(torch.tensor([-1.0]), torch.tensor([-1.5]), beta=2.0, loss_type="kto")


def test_log1mexp_is_accurate_on_both_sides_of_its_switch() -> None:
    """log(1 - e^x), against float64, near 0 (where 1 - e^x cancels) and far below it."""
    x = torch.tensor([-1e-6, -0.1, -0.5, -0.7, -0.69, -1.0, -2.0, -30.0])
    expected = [math.log(-math.expm1(v)) for v in x.double().tolist()]
    assert log1mexp(x).tolist() == pytest.approx(expected, rel=1e-5)


def test_defaults_are_the_papers() -> None:
    """cpo_loss defaults to CPO's sigmoid loss, SimPO's margin to 0; kto_loss weighs both sides 1."""
    chosen, rejected = torch.tensor([-1.0, -3.0]), torch.tensor([-1.5, -0.5])
    assert torch.equal(
        cpo_loss(chosen, rejected, beta=0.5)[0],
        cpo_loss(chosen, rejected, beta=0.5, loss_type="sigmoid", simpo_gamma=0.0, label_smoothing=0.0)[0],
    )
    simpo = cpo_loss(chosen, rejected, beta=0.5, loss_type="simpo")[0]
    assert torch.equal(simpo, cpo_loss(chosen, rejected, beta=0.5, loss_type="simpo", simpo_gamma=0.0)[0])
    # the margin γ is SimPO's alone: CPO's sigmoid loss ignores it
    sigmoid = cpo_loss(chosen, rejected, beta=0.5, simpo_gamma=0.7)[0]
    assert torch.equal(sigmoid, cpo_loss(chosen, rejected, beta=0.5)[0])
    kl = torch.tensor(0.1)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            kto_loss(chosen, rejected, kl, beta=0.5),
            kto_loss(chosen, rejected, kl, beta=0.5, desirable_weight=1.0, undesirable_weight=1.0),
            strict=True,
        )
    )


# -- data and config errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_errors_name_the_input(method: str, tiny_model_path: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        train(method, make(method, tiny_model_path, tmp_path, max_length=8), separable_rows(4))
    assert err.value.param == "hyperparameters.max_length"
    with pytest.raises(DataError) as err:
        train(
            method,
            make(method, tiny_model_path, tmp_path),
            [{"prompt": "x", "completion": "y", "label": True}],
        )
    assert err.value.param == "training_file" and "line 1" in err.value.message
    with pytest.raises(DataError) as err:
        train(method, make(method, tiny_model_path, tmp_path, beta=0.0), separable_rows(2))
    assert err.value.param == "hyperparameters.beta"


# -- training -----------------------------------------------------------------------------------------

LEARN: dict[str, dict[str, Any]] = {
    "orpo": {"beta": 0.5},
    "cpo": {"beta": 0.1},
    "simpo": {},
}


@pytest.mark.parametrize("method", METHODS)
def test_learns_a_separable_preference(method: str, tiny_model_path: Path, tmp_path: Path) -> None:
    rows = separable_rows(32)
    config = make(
        method,
        tiny_model_path,
        tmp_path,
        learning_rate=1e-2,
        n_epochs=2,
        max_steps=10,
        batch_size=4,
        **LEARN[method],
    )
    rec = Recorder()
    result = train(method, config, rows[:24], rows[24:], rec)
    margins = [row["rewards/margins"] for row in rec.steps]
    losses = rec.losses
    print(f"\n{method}: rewards/margins {margins[0]:.3f} -> {margins[-1]:.3f}", end="")
    print(f", loss {losses[0]:.3f} -> {losses[-1]:.3f}")  # `-s` shows it
    assert margins[-1] > max(margins[0], 0.0) + 0.2, margins
    assert min(row["rewards/accuracies"] for row in rec.steps[-3:]) >= 0.9
    assert rec.losses[-1] < rec.losses[0], rec.losses
    assert rec.evals[-1]["valid_rewards/accuracies"] >= 0.9
    expected = {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "nll_loss",
    }
    assert expected <= set(rec.steps[-1])
    assert result.final_checkpoint is not None and result.final_checkpoint.final
    AutoModelForCausalLM.from_pretrained(result.final_checkpoint.path / "model")


@pytest.mark.parametrize("method", METHODS)
def test_resume_repeats_the_uninterrupted_run(method: str, tiny_model_path: Path, tmp_path: Path) -> None:
    rows = separable_rows(16)
    fields = {**RESUME_RUN, "lora_dropout": 0.1, "learning_rate": 1e-2}
    full = Recorder()
    train(method, make(method, tiny_model_path, tmp_path / "a", **fields), rows, rows[:4], full)
    assert [(c.step, c.final) for c in full.checkpoints] == [(3, False), (6, True)]
    resumed = Recorder()
    mid = str(full.checkpoints[0].path)
    train(
        method,
        make(method, tiny_model_path, tmp_path / "b", **fields, resume_from=mid),
        rows,
        rows[:4],
        resumed,
    )
    assert [int(r["step"]) for r in resumed.steps] == [4, 5, 6]
    for ours, theirs in zip(resumed.steps, full.steps[3:], strict=True):
        for key in ("loss", "learning_rate", "grad_norm", "rewards/margins", "nll_loss", "trained_tokens"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-5), key
    assert resumed.evals[-1]["valid_loss"] == pytest.approx(full.evals[-1]["valid_loss"], abs=1e-5)
