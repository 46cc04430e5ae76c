"""KTO: the loss equals TRL's ``KTOTrainer`` on the same model, reference and batch (mismatched KL pairs
included), the equation by hand, unpaired rows and their errors, the model learns from labels alone, and
a resumed run repeats the uninterrupted one."""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase
from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference, KTOTrainer
from trl.trainer.utils import add_fused_lm_head

from tests.trainers.helpers import RESUME_RUN, Recorder
from tests.trainers.methods.test_dpo import separable_rows
from trainers.core.errors import DataError
from trainers.core.loop import run_training
from trainers.data.preference import tokenize_preference_rows
from trainers.data.unpaired import UnpairedExample, collate_unpaired, tokenize_unpaired_rows
from trainers.families.entry import load_model_to_train
from trainers.families.reference import Reference
from trainers.losses.preference import kto_loss
from trainers.methods.kto import KTOConfig, KTOLoss, build_kto_task, train_kto

CITIES = ["Paris", "Lima", "Tokyo", "Dublin", "Rome", "Oslo", "Madrid", "Cairo"]


def feedback_rows(n: int, *, shape: str = "prompt") -> list[dict[str, Any]]:
    """Alternating good ("Yes, ... is a city.") and bad ("No, ... is a river.") answers, unpaired."""
    rows: list[dict[str, Any]] = []
    for i in range(n):
        city, good = CITIES[i % 8], i % 2 == 0
        question = f"Is {city} a city? ({i})"
        answer = f"Yes, {city} is a city." if good else f"No, {city} is a river."
        if shape == "prompt":
            rows.append({"prompt": question, "completion": " " + answer, "label": good})
        elif shape == "chat":
            rows.append(
                {
                    "prompt": [{"role": "user", "content": question}],
                    "completion": [{"role": "assistant", "content": answer}],
                    "label": good,
                }
            )
        else:
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            rows.append({"messages": messages, "label": good})
    return rows


def make(tiny_model_path: Path, output_dir: Path, **fields: Any) -> KTOConfig:
    return KTOConfig(model_path=str(tiny_model_path), output_dir=str(output_dir), **fields)


# -- loss vs TRL --------------------------------------------------------------------------------------


def trl_kto_loss(
    model: torch.nn.Module, ref: torch.nn.Module, examples: list[UnpairedExample], pad: int, **hp: Any
) -> tuple[float, dict[str, float]]:
    """TRL 1.16's ``KTOTrainer._compute_loss`` with its own collator and KL completions (each example's
    completion moved to the next example, as its dataset preparation does), on fused-head copies of the
    models, in a trainer object that holds only the attributes that code reads."""
    features = [
        {"prompt_ids": e.prompt_ids, "completion_ids": e.completion_ids, "label": e.label} for e in examples
    ]
    completions = [f["completion_ids"] for f in features]
    for feature, kl_completion in zip(features, [completions[-1], *completions[:-1]], strict=True):
        feature["KL_completion_ids"] = kl_completion
    inputs = DataCollatorForUnpairedPreference(pad_token_id=pad, max_length=hp.pop("max_length"))(features)
    model, ref = copy.deepcopy(model), copy.deepcopy(ref)
    for m in (model, ref):
        add_fused_lm_head(m, outputs=("log_probs", "entropy", "mean_logits"))
    trainer = KTOTrainer.__new__(KTOTrainer)
    trainer.__dict__.update(
        model=model,
        ref_model=ref,
        accelerator=SimpleNamespace(
            device=torch.device("cpu"), gather_for_metrics=lambda x: x, unwrap_model=lambda m: m
        ),
        calculate_KL=True,
        aux_loss_enabled=False,
        precompute_ref_logps=False,
        loss_type="kto",
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        **hp,
    )
    loss = KTOTrainer._compute_loss(trainer, model, inputs, False)
    return float(loss.detach()), {k: v[-1] for k, v in trainer._metrics["eval"].items()}


# TRL's gradient-checkpointing guard reads an attribute transformers 5 deprecates
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize(
    "hp",
    [
        {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0, "max_length": 64},
        {"beta": 0.3, "desirable_weight": 1.33, "undesirable_weight": 0.7, "max_length": 64},
        # the prompts fill most of max_length: completions and KL completions are truncated
        {"beta": 0.2, "desirable_weight": 1.0, "undesirable_weight": 2.0, "max_length": 20},
    ],
)
def test_kto_loss_equals_trl(
    hp: dict[str, Any], tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    model = copy.deepcopy(ref)
    with torch.no_grad():  # the policy has moved from the reference: non-zero log-ratios and KL
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rows = feedback_rows(3) + feedback_rows(4, shape="messages")[1:]  # 3 good, 3 bad, in a mixed order
    examples = [
        *tokenize_unpaired_rows(rows[:3], tokenizer, max_length=hp["max_length"]),
        *tokenize_unpaired_rows(rows[3:], tokenizer, max_length=hp["max_length"]),
    ]
    pad = tokenizer.pad_token_id
    assert isinstance(pad, int)
    theirs, metrics = trl_kto_loss(model, ref, examples, pad, **hp)
    loss_fn = KTOLoss(hp["beta"], hp["desirable_weight"], hp["undesirable_weight"], Reference.frozen(ref))
    out = loss_fn(model, collate_unpaired(examples, pad_token_id=pad, max_length=hp["max_length"]))
    assert out.loss.item() / len(examples) == pytest.approx(theirs, abs=1e-5)
    assert out.metrics["kl"] / len(examples) == pytest.approx(metrics["kl"], abs=1e-5)
    assert metrics["kl"] > 0  # the reference point is in play
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert out.metrics[key] / out.metric_units[key] == pytest.approx(metrics[key], abs=1e-4), key


def test_kto_loss_by_hand() -> None:
    """Eq. 7 on one desirable (r = 1) and one undesirable (r = -0.5) example, z₀ = 0.25, β = 2."""
    chosen, rejected = kto_loss(
        torch.tensor([1.0]), torch.tensor([-0.5]), torch.tensor(0.25), beta=2.0, undesirable_weight=1.5
    )
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert chosen.item() == pytest.approx(1 - sigmoid(2.0 * (1.0 - 0.25)), abs=1e-6)
    assert rejected.item() == pytest.approx(1.5 * (1 - sigmoid(2.0 * (0.25 + 0.5))), abs=1e-6)


# -- data ---------------------------------------------------------------------------------------------


def test_unpaired_rows_in_each_shape(tokenizer: PreTrainedTokenizerBase) -> None:
    [plain] = tokenize_unpaired_rows(feedback_rows(1), tokenizer, max_length=64)
    assert tokenizer.decode(plain.prompt_ids) == "<|begin|>Is Paris a city? (0)"
    assert tokenizer.decode(plain.completion_ids) == " Yes, Paris is a city.<|end|>" and plain.label
    [chat] = tokenize_unpaired_rows(feedback_rows(1, shape="chat"), tokenizer, max_length=64)
    [messages] = tokenize_unpaired_rows(feedback_rows(1, shape="messages"), tokenizer, max_length=64)
    assert chat == messages  # the two chat shapes are the same example
    assert (
        tokenizer.decode(chat.prompt_ids) == "<|begin|><|user|>\nIs Paris a city? (0)<|end|><|assistant|>\n"
    )
    assert tokenizer.decode(chat.completion_ids) == "Yes, Paris is a city.<|end|>"
    cut = tokenize_unpaired_rows(
        feedback_rows(1, shape="chat"), tokenizer, max_length=12, max_prompt_length=8
    )[0]
    assert cut.prompt_ids == chat.prompt_ids[-8:] and cut.completion_ids == chat.completion_ids[:4]


def test_preference_pairs_are_unpaired(tokenizer: PreTrainedTokenizerBase) -> None:
    pairs = tokenize_preference_rows(separable_rows(2), tokenizer, max_length=64)
    examples = tokenize_unpaired_rows(separable_rows(2), tokenizer, max_length=64)
    assert [(e.prompt_ids, e.completion_ids, e.label) for e in examples] == [
        (pair.prompt_ids, completion, label)
        for pair in pairs
        for completion, label in ((pair.chosen_ids, True), (pair.rejected_ids, False))
    ]


def test_kl_rows_pair_each_prompt_with_the_previous_completion(tokenizer: PreTrainedTokenizerBase) -> None:
    examples = [
        UnpairedExample([1, 2], [3], True),
        UnpairedExample([4], [5, 6], False),
        UnpairedExample([7], [8], True),
    ]
    batch = collate_unpaired(examples, pad_token_id=0, max_length=3)
    assert batch.input_ids.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 0]]
    assert batch.kl.input_ids.tolist() == [[1, 2, 8], [4, 3, 0], [7, 5, 6]]
    assert batch.kl.completion_mask.tolist() == [
        [False, False, True],
        [False, True, False],
        [False, True, True],
    ]
    assert batch.labels.tolist() == [True, False, True] and batch.loss_denominator == 3


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "x", "completion": "y", "label": "yes"}, 'line 2: "label" must be true or false'),
        # once the file is unpaired feedback, a row without its label is one missing it (trainers.formats)
        ({"prompt": "x", "completion": "y"}, 'line 2: "label" must be true or false'),
        ({"messages": [{"role": "user", "content": "x"}], "label": True}, "line 2: every row must have"),
        ({"prompt": "x", "completion": 3, "label": True}, "line 2: field 'completion': expected a non-empty"),
    ],
)
def test_malformed_rows_name_the_line(
    row: dict[str, Any], message: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    with pytest.raises(DataError, match=message) as err:
        tokenize_unpaired_rows([feedback_rows(1)[0], row], tokenizer, max_length=64)
    assert err.value.param == "training_file"
    bad_chat = {
        "messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}],
        "label": True,
    }
    judged = r"line 1: field 'messages\[1\].role': the last message must be the assistant's judged"
    with pytest.raises(DataError, match=judged):
        tokenize_unpaired_rows([bad_chat], tokenizer, max_length=64)


def test_config_errors_name_the_field(tiny_model_path: Path, tmp_path: Path) -> None:
    for fields, param in [
        ({"batch_size": 1}, "batch_size"),  # no other completion in the micro-batch for the KL estimate
        ({"desirable_weight": 0.0}, "desirable_weight"),
        ({"max_length": 8}, "max_length"),
    ]:
        with pytest.raises(DataError) as err:
            train_kto(make(tiny_model_path, tmp_path, **fields), feedback_rows(4))
        assert err.value.param == f"hyperparameters.{param}"


# -- training -----------------------------------------------------------------------------------------


def test_kto_learns_from_labels(tiny_model_path: Path, tmp_path: Path) -> None:
    rows = feedback_rows(32, shape="chat")
    config = make(
        tiny_model_path, tmp_path, learning_rate=1e-2, n_epochs=2, max_steps=10, batch_size=4, beta=0.5
    )
    rec = Recorder()
    result = train_kto(config, rows[:24], rows[24:], rec)
    # a step whose examples all have one label reports the rewards of that label only
    gaps = [
        r["rewards/chosen"] - r["rewards/rejected"]
        for r in rec.steps
        if "rewards/rejected" in r and "rewards/chosen" in r
    ]
    print(f"\nkto: rewards/chosen - rewards/rejected {gaps[0]:.3f} -> {gaps[-1]:.3f}", end="")
    print(f", loss {rec.losses[0]:.3f} -> {rec.losses[-1]:.3f}")  # `-s` shows it
    assert rec.steps[0]["loss"] == pytest.approx(0.5, abs=1e-6)  # policy == reference: 1 - σ(0)
    assert gaps[-1] > 1.0, gaps
    assert rec.losses[-1] < rec.losses[0] - 0.1, rec.losses
    assert rec.steps[0]["kl"] == 0.0 and {"kl", "logps/chosen", "logps/rejected"} <= set(rec.steps[-1])
    last_eval = rec.evals[-1]
    assert last_eval["valid_rewards/chosen"] > last_eval["valid_rewards/rejected"]
    assert result.final_checkpoint is not None
    AutoModelForCausalLM.from_pretrained(result.final_checkpoint.path / "model")


def test_metrics_average_over_their_own_examples(
    tiny_model_path: Path, tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """In a step of 3 desirable examples and 1 undesirable one, rewards/chosen is the mean over the 3 (not
    their sum / 4); a step with no undesirable example reports no rewards/rejected."""
    config = make(tiny_model_path, tmp_path, max_steps=1, batch_size=4, learning_rate=1e-2)
    rows = [{**r, "label": True} for r in feedback_rows(3)] + [feedback_rows(2)[1]]
    examples = tokenize_unpaired_rows(rows, tokenizer, max_length=64)
    model = load_model_to_train(config, torch.device("cpu"))
    task = build_kto_task(config, model, tokenizer, examples)
    out = task.loss_fn(model, task.collate(examples))
    assert out.metric_units == {
        "rewards/chosen": 3,
        "logps/chosen": 3,
        "rewards/rejected": 1,
        "logps/rejected": 1,
    }
    mixed = Recorder()
    run_training(config, task, mixed)
    assert mixed.steps[0]["logps/chosen"] == pytest.approx(out.metrics["logps/chosen"] / 3, abs=1e-5)
    only_good = Recorder()
    config = replace(config, output_dir=str(tmp_path / "good"))
    task = build_kto_task(config, load_model_to_train(config, torch.device("cpu")), tokenizer, examples[:3])
    run_training(config, task, only_good)
    assert "rewards/chosen" in only_good.steps[0] and "rewards/rejected" not in only_good.steps[0]


def test_resume_repeats_the_uninterrupted_run(tiny_model_path: Path, tmp_path: Path) -> None:
    """Full fine-tuning, where the resumed run must rebuild its reference from the base, not from the
    checkpoint (a LoRA reference is the adapter-disabled model, as DPO's resume test covers)."""
    method = {"use_lora": False, "learning_rate": 1e-3}
    rows = feedback_rows(16)
    full = Recorder()
    train_kto(make(tiny_model_path, tmp_path / "a", **RESUME_RUN, **method), rows, rows[:4], full)
    assert [(c.step, c.final) for c in full.checkpoints] == [(3, False), (6, True)]
    resumed = Recorder()
    mid = str(full.checkpoints[0].path)
    train_kto(
        make(tiny_model_path, tmp_path / "b", **RESUME_RUN, **method, resume_from=mid),
        rows,
        rows[:4],
        resumed,
    )
    assert [int(r["step"]) for r in resumed.steps] == [4, 5, 6]
    for ours, theirs in zip(resumed.steps, full.steps[3:], strict=True):
        assert set(ours) == set(theirs)
        for key in ("loss", "learning_rate", "grad_norm", "kl", "trained_tokens"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-5), key
    assert resumed.evals[-1]["valid_loss"] == pytest.approx(full.evals[-1]["valid_loss"], abs=1e-5)
