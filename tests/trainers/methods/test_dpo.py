"""DPO: losses equal TRL's on the same log-probs, log-probs equal a per-token reference, the reference
stays the starting model (without a second copy for LoRA), the model learns a separable preference,
and a resumed run repeats the uninterrupted one."""

from __future__ import annotations

import gc
import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedTokenizerBase
from trl.trainer.dpo_trainer import DPOTrainer

from tests.trainers.helpers import RESUME_RUN, Recorder
from trainers.core.errors import DataError
from trainers.core.loop import run_training
from trainers.data.preference import collate_preferences, tokenize_preference_rows
from trainers.families.entry import load_model_to_train
from trainers.families.reference import policy_log_probs
from trainers.losses.preference import dpo_loss
from trainers.methods.dpo import DPOConfig, DPOLoss, build_dpo_task, train_dpo

CITIES = ["Paris", "Lima", "Tokyo", "Dublin", "Rome", "Oslo", "Madrid", "Cairo"]


def separable_rows(n: int) -> list[dict[str, Any]]:
    """OpenAI-format pairs whose chosen answer always says "Yes" and rejected one "No"."""
    return [
        {
            "input": {"messages": [{"role": "user", "content": f"Is {CITIES[i % 8]} a city? ({i})"}]},
            "preferred_output": [{"role": "assistant", "content": f"Yes, {CITIES[i % 8]} is a city."}],
            "non_preferred_output": [{"role": "assistant", "content": f"No, {CITIES[i % 8]} is a river."}],
        }
        for i in range(n)
    ]


STRING_ROWS = [
    {"prompt": "Q: What is the capital of France?\nA:", "chosen": " Paris.", "rejected": " Lyon, I think."},
    {"prompt": "Tell me more.", "chosen": " The robot read books.", "rejected": " No."},
    {"prompt": "Q: Name the capital city of Japan.\nA:", "chosen": " Tokyo.", "rejected": " Kyoto."},
]


@pytest.fixture
def make_config(tiny_model_path: Path, tmp_path: Path) -> Callable[..., DPOConfig]:
    def make(**overrides: Any) -> DPOConfig:
        fields: dict[str, Any] = {"model_path": str(tiny_model_path), "output_dir": str(tmp_path / "out")}
        return DPOConfig(**(fields | overrides))

    return make


# -- losses vs TRL ------------------------------------------------------------------------------------


def trl_dpo_loss(
    per_token_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    ref_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str,
    label_smoothing: float,
) -> tuple[float, dict[str, float]]:
    """TRL 1.16's ``DPOTrainer._compute_loss`` on given log-probs: a stand-in model returns them, and the
    reference log-probs come in as precomputed, so TRL's own loss code runs without a model."""
    n_rows = per_token_logps.shape[0]
    outputs = SimpleNamespace(
        log_probs=per_token_logps,
        entropy=torch.zeros_like(per_token_logps),
        mean_logits=torch.zeros_like(per_token_logps),
        is_top1=torch.zeros_like(per_token_logps, dtype=torch.bool),
    )
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(
            device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x
        ),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros_like(completion_mask),
        "attention_mask": torch.ones_like(completion_mask),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_logps[: n_rows // 2],
        "ref_rejected_logps": ref_logps[n_rows // 2 :],
    }
    loss = DPOTrainer._compute_loss(trainer, lambda **_: outputs, inputs, False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize(
    ("loss_type", "label_smoothing", "trl_loss_type"),
    [
        ("sigmoid", 0.0, "sigmoid"),
        # TRL 1.16's "sigmoid" has no label smoothing; conservative DPO's -(1-ε)logσ(βh) - ε logσ(-βh) is
        # in its "aot_unpaired", which sorts the chosen and the rejected log-ratios separately: on
        # log-ratios already in ascending order (arranged below) it is exactly cDPO, pair by pair.
        ("sigmoid", 0.2, "aot_unpaired"),
        ("ipo", 0.0, "ipo"),
        ("hinge", 0.0, "hinge"),
    ],
)
def test_dpo_loss_equals_trl(loss_type: str, label_smoothing: float, trl_loss_type: str) -> None:
    gen = torch.Generator().manual_seed(0)
    n_pairs, width, beta = 6, 9, 0.3
    completion_mask = torch.zeros(2 * n_pairs, width, dtype=torch.long)
    lengths = torch.randint(1, width, (2 * n_pairs,), generator=gen)
    for row, length in enumerate(lengths.tolist()):
        completion_mask[row, width - length :] = 1
    per_token = -3 * torch.rand(2 * n_pairs, width - 1, generator=gen) * completion_mask[:, 1:]
    logps = per_token.sum(dim=1)
    ref_logps = logps + torch.randn(2 * n_pairs, generator=gen)
    if trl_loss_type == "aot_unpaired":  # make both log-ratio vectors ascending, keeping the values random
        ratios = (logps - ref_logps).view(2, n_pairs).sort(dim=1).values.flatten()
        ref_logps = logps - ratios

    trl_loss, trl_metrics = trl_dpo_loss(
        per_token,
        completion_mask,
        ref_logps,
        beta=beta,
        loss_type=trl_loss_type,
        label_smoothing=label_smoothing,
    )
    lengths = completion_mask[:, 1:].sum(dim=1).float()
    losses, chosen_rewards, rejected_rewards = dpo_loss(
        logps[:n_pairs],
        logps[n_pairs:],
        ref_logps[:n_pairs],
        ref_logps[n_pairs:],
        beta=beta,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
        chosen_lengths=lengths[:n_pairs],
        rejected_lengths=lengths[n_pairs:],
    )
    assert losses.shape == chosen_rewards.shape == (n_pairs,)
    assert losses.mean().item() == pytest.approx(trl_loss, abs=1e-5)
    assert chosen_rewards.mean().item() == pytest.approx(trl_metrics["rewards/chosen"], abs=1e-5)
    assert rejected_rewards.mean().item() == pytest.approx(trl_metrics["rewards/rejected"], abs=1e-5)
    accuracy = (chosen_rewards > rejected_rewards).float().mean().item()
    assert accuracy == pytest.approx(trl_metrics["rewards/accuracies"], abs=1e-6)


def test_dpo_loss_by_hand() -> None:
    """The three losses on one pair, written out (h = 1.5 - (-0.5) = 2, β = 0.5)."""
    args = (torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.5]), torch.tensor([-2.5]))
    sigmoid = dpo_loss(*args, beta=0.5, loss_type="sigmoid")[0].item()
    smoothed = dpo_loss(*args, beta=0.5, loss_type="sigmoid", label_smoothing=0.1)[0].item()
    assert sigmoid == pytest.approx(math.log1p(math.exp(-1.0)), abs=1e-6)
    assert smoothed == pytest.approx(
        0.9 * math.log1p(math.exp(-1.0)) + 0.1 * math.log1p(math.exp(1.0)), abs=1e-6
    )
    assert dpo_loss(*args, beta=0.5, loss_type="ipo")[0].item() == pytest.approx((2 - 1) ** 2)
    assert dpo_loss(*args, beta=0.25, loss_type="hinge")[0].item() == pytest.approx(0.5)


# -- log-probs and data -------------------------------------------------------------------------------


@torch.no_grad()
def test_policy_log_probs_equal_per_token_reference(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    for rows in (STRING_ROWS, separable_rows(3)):
        examples = tokenize_preference_rows(rows, tokenizer, max_length=64)
        batch = collate_preferences(examples, pad_token_id=tokenizer.pad_token_id)
        ours = policy_log_probs(model, batch)
        # Reference: each sequence alone, unpadded, log-softmax in float64 summed over completion tokens.
        sequences = [(e.prompt_ids, e.chosen_ids) for e in examples] + [
            (e.prompt_ids, e.rejected_ids) for e in examples
        ]
        for row, (prompt, completion) in enumerate(sequences):
            ids = prompt + completion
            log_probs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
            expected = sum(log_probs[t - 1, ids[t]].item() for t in range(len(prompt), len(ids)))
            # float32 log-softmax summed over ~30 tokens of ~3 nats each: 1e-5 absolute, or 1e-6 relative.
            assert ours[row].item() == pytest.approx(expected, abs=1e-5, rel=1e-6)


def test_preference_rows_tokenize_prompt_and_completion(tokenizer: PreTrainedTokenizerBase) -> None:
    [chat] = tokenize_preference_rows(separable_rows(1), tokenizer, max_length=64)
    assert (
        tokenizer.decode(chat.prompt_ids) == "<|begin|><|user|>\nIs Paris a city? (0)<|end|><|assistant|>\n"
    )
    assert tokenizer.decode(chat.chosen_ids) == "Yes, Paris is a city.<|end|>"
    assert tokenizer.decode(chat.rejected_ids) == "No, Paris is a river.<|end|>"
    text = tokenize_preference_rows(STRING_ROWS[:1], tokenizer, max_length=64)[0]
    assert tokenizer.decode(text.prompt_ids) == "<|begin|>Q: What is the capital of France?\nA:"
    assert tokenizer.decode(text.chosen_ids) == " Paris.<|end|>"
    # The prompt keeps its last max_prompt_length tokens; then each sequence is cut to max_length.
    cut = tokenize_preference_rows(separable_rows(1), tokenizer, max_length=12, max_prompt_length=8)[0]
    assert cut.prompt_ids == chat.prompt_ids[-8:]
    assert cut.chosen_ids == chat.chosen_ids[:4] and cut.rejected_ids == chat.rejected_ids[:4]


def test_data_errors_name_the_input(make_config: Callable[..., DPOConfig]) -> None:
    with pytest.raises(DataError) as err:
        train_dpo(make_config(max_length=8), separable_rows(4))
    assert err.value.param == "hyperparameters.max_length"
    with pytest.raises(DataError) as err:
        train_dpo(make_config(), [{"prompt": "x", "chosen": 3, "rejected": "y"}])
    assert err.value.param == "training_file" and "line 1" in err.value.message
    with pytest.raises(DataError) as err:
        train_dpo(make_config(), separable_rows(2), [{"messages": []}])
    assert err.value.param == "validation_file"
    with pytest.raises(DataError) as err:
        train_dpo(make_config(loss_type="kto"), separable_rows(2))
    assert err.value.param == "hyperparameters.loss_type"


# -- the reference ------------------------------------------------------------------------------------


def test_lora_reference_is_the_adapter_disabled_base_without_a_copy(
    make_config: Callable[..., DPOConfig], tokenizer: PreTrainedTokenizerBase
) -> None:
    config = make_config(use_lora=True)
    examples = tokenize_preference_rows(separable_rows(12), tokenizer, max_length=64)
    gc.collect()
    before = {id(m) for m in gc.get_objects() if type(m) is LlamaForCausalLM}
    model = load_model_to_train(config, torch.device("cpu"))
    task = build_dpo_task(config, model, tokenizer, examples)
    gc.collect()
    created = [m for m in gc.get_objects() if type(m) is LlamaForCausalLM and id(m) not in before]
    assert created == [model.get_base_model()]  # one copy of the base weights: the policy's own
    loss = task.loss_fn
    assert isinstance(loss, DPOLoss) and loss.reference is not None
    assert loss.reference.model is model and loss.reference.disable_adapter


def test_lora_reference_log_probs_are_the_base_models_while_training(
    make_config: Callable[..., DPOConfig], tokenizer: PreTrainedTokenizerBase, tiny_model_path: Path
) -> None:
    config = make_config(use_lora=True)
    examples = tokenize_preference_rows(separable_rows(12), tokenizer, max_length=64)
    model = load_model_to_train(config, torch.device("cpu"))
    task = build_dpo_task(config, model, tokenizer, examples)
    loss = task.loss_fn
    assert isinstance(loss, DPOLoss) and loss.reference is not None
    batch = collate_preferences(examples[:4], pad_token_id=tokenizer.pad_token_id)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = policy_log_probs(base, batch)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        loss(model, batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        assert not torch.allclose(policy_log_probs(model, batch), expected, atol=1e-3)  # the policy moved
        assert torch.allclose(loss.reference(batch), expected, atol=1e-5)  # ...its reference did not


def test_full_reference_is_a_frozen_copy(
    make_config: Callable[..., DPOConfig], tokenizer: PreTrainedTokenizerBase
) -> None:
    config = make_config(use_lora=False, learning_rate=1e-3, max_steps=3, batch_size=4)
    examples = tokenize_preference_rows(separable_rows(12), tokenizer, max_length=64)
    model = load_model_to_train(config, torch.device("cpu"))
    task = build_dpo_task(config, model, tokenizer, examples)
    loss = task.loss_fn
    assert isinstance(loss, DPOLoss) and loss.reference is not None
    ref = loss.reference.model
    assert ref is not model and not loss.reference.disable_adapter
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    policy_ptrs = {p.data_ptr() for p in model.parameters()}
    assert not any(p.data_ptr() in policy_ptrs for p in ref.parameters())
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    start = {k: v.clone() for k, v in model.state_dict().items()}
    run_training(config, task)
    assert all(torch.equal(before[k], v) for k, v in ref.state_dict().items())
    assert any(not torch.equal(start[k], v) for k, v in model.state_dict().items())


def test_reference_that_is_the_policy_is_refused(
    make_config: Callable[..., DPOConfig], tokenizer: PreTrainedTokenizerBase
) -> None:
    examples = tokenize_preference_rows(separable_rows(4), tokenizer, max_length=64)
    for use_lora in (False, True):
        config = make_config(use_lora=use_lora)
        model = load_model_to_train(config, torch.device("cpu"))
        same = [model, model.get_base_model()] if use_lora else [model]  # the LoRA base shares the weights
        for ref in same:
            with pytest.raises(ValueError, match=r"ref_model=None.*separate copy"):
                build_dpo_task(config, model, tokenizer, examples, ref_model=ref)


@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
def test_precomputed_reference_gives_the_same_losses(
    make_config: Callable[..., DPOConfig], tmp_path: Path, use_lora: bool
) -> None:
    rows = separable_rows(12)
    common = {
        "use_lora": use_lora,
        "learning_rate": 1e-2 if use_lora else 1e-3,
        "max_steps": 2,
        "batch_size": 4,
    }
    live, pre = Recorder(), Recorder()
    train_dpo(make_config(**common, output_dir=str(tmp_path / "live")), rows, rows[:4], live)
    train_dpo(
        make_config(**common, output_dir=str(tmp_path / "pre"), precompute_ref_log_probs=True),
        rows,
        rows[:4],
        pre,
    )
    assert pre.losses == pytest.approx(live.losses, abs=1e-5)
    assert pre.evals[-1]["valid_loss"] == pytest.approx(live.evals[-1]["valid_loss"], abs=1e-5)


def test_precompute_keeps_no_reference_model(
    make_config: Callable[..., DPOConfig], tokenizer: PreTrainedTokenizerBase
) -> None:
    config = make_config(use_lora=False, precompute_ref_log_probs=True, batch_size=4)
    examples = tokenize_preference_rows(separable_rows(6), tokenizer, max_length=64)
    model = load_model_to_train(config, torch.device("cpu"))
    task = build_dpo_task(config, model, tokenizer, examples)
    assert isinstance(task.loss_fn, DPOLoss) and task.loss_fn.reference is None
    assert all(e.ref_chosen_logp is not None and e.ref_rejected_logp is not None for e in task.train_data)


# -- training -----------------------------------------------------------------------------------------


def test_dpo_learns_a_separable_preference(
    make_config: Callable[..., DPOConfig], tiny_model_path: Path
) -> None:
    rows = separable_rows(32)
    config = make_config(use_lora=True, learning_rate=1e-2, beta=0.5, max_steps=10, batch_size=4)
    rec = Recorder()
    result = train_dpo(config, rows[:24], rows[24:], rec)
    accuracies = [row["rewards/accuracies"] for row in rec.steps]
    assert accuracies[0] == 0.0  # policy == reference at the first step: no margin yet
    assert min(accuracies[-3:]) >= 0.9, accuracies
    assert rec.losses[-1] < rec.losses[0] - 0.3, rec.losses
    assert rec.steps[-1]["rewards/margins"] > 0
    assert rec.evals[-1]["valid_rewards/accuracies"] >= 0.9
    expected = {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    }
    assert expected <= set(rec.steps[-1])
    assert {"valid_loss", "valid_rewards/accuracies"} <= set(rec.evals[-1])

    assert result.final_checkpoint is not None and result.final_checkpoint.final
    model_dir = result.final_checkpoint.path / "model"
    assert not (model_dir / "adapter_config.json").exists()  # merged: a plain causal LM
    AutoModelForCausalLM.from_pretrained(model_dir)
    before, after = (
        load_file(tiny_model_path / "model.safetensors"),
        load_file(model_dir / "model.safetensors"),
    )
    assert before.keys() == after.keys()
    assert not torch.equal(
        before["model.layers.0.self_attn.q_proj.weight"], after["model.layers.0.self_attn.q_proj.weight"]
    )


RESUME = RESUME_RUN


@pytest.mark.parametrize(
    "method",
    [
        {"use_lora": True, "lora_dropout": 0.1, "learning_rate": 1e-2},
        # Full fine-tuning: the resumed run must rebuild its reference from the base, not the checkpoint.
        {"use_lora": False, "learning_rate": 1e-3},
    ],
    ids=["lora", "full"],
)
def test_resume_repeats_the_uninterrupted_run(
    make_config: Callable[..., DPOConfig], tmp_path: Path, method: dict[str, Any]
) -> None:
    rows = separable_rows(16)
    full = Recorder()
    train_dpo(make_config(**RESUME, **method, output_dir=str(tmp_path / "a")), rows, rows[:4], full)
    assert [(c.step, c.final) for c in full.checkpoints] == [(3, False), (6, True)]
    resumed = Recorder()
    mid = str(full.checkpoints[0].path)
    train_dpo(
        make_config(**RESUME, **method, output_dir=str(tmp_path / "b"), resume_from=mid),
        rows,
        rows[:4],
        resumed,
    )
    assert [int(r["step"]) for r in resumed.steps] == [4, 5, 6]
    for ours, theirs in zip(resumed.steps, full.steps[3:], strict=True):
        for key in (
            "loss",
            "learning_rate",
            "grad_norm",
            "rewards/margins",
            "logps/chosen",
            "trained_tokens",
        ):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-5), key
    assert resumed.evals[-1]["valid_loss"] == pytest.approx(full.evals[-1]["valid_loss"], abs=1e-5)


def test_a_separate_reference_copy_matches_the_default(
    make_config: Callable[..., DPOConfig], tiny_model_path: Path, tmp_path: Path
) -> None:
    rows = separable_rows(8)
    common = {"use_lora": False, "learning_rate": 1e-3, "max_steps": 2, "batch_size": 4}
    default, explicit = Recorder(), Recorder()
    train_dpo(make_config(**common, output_dir=str(tmp_path / "a")), rows, callbacks=default)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    train_dpo(make_config(**common, output_dir=str(tmp_path / "b")), rows, callbacks=explicit, ref_model=ref)
    assert explicit.losses == pytest.approx(default.losses, abs=1e-6)
