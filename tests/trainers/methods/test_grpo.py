"""GRPO (its advantages and loss: test_advantages.py, test_rl_losses.py): the loss of the batches the
loop builds equals TRL's; rollouts; learning; one base copy with LoRA; resume; cancel."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

import trainers.methods.grpo
from tests.trainers.helpers import Recorder
from tests.trainers.losses.test_advantages import trl_group_advantages
from tests.trainers.losses.test_rl_losses import trl_grpo_loss
from trainers.core.errors import DataError
from trainers.core.loop import PreparedStep, StopRequest
from trainers.families.group_rollout import GroupRollouts
from trainers.families.rollout import (
    GRPOBatch,
    RLPrompt,
    completion_logps,
    completion_mask_from_eos,
    generate_rollout,
    tokenize_rl_rows,
)
from trainers.methods.grpo import GRPOConfig, train_grpo
from trainers.rewards.graders import build_grader
from trainers.rewards.reward_set import RewardSet

PROMPTS = ["The capital of Peru is", "Hello", "What is two plus two?", "Name a color:"]
ROWS = [{"prompt": p, "answer": "e"} for p in PROMPTS] * 4
# About half of the tiny model's 4-token samples contain an "e": a reachable, verifiable target.
HAS_E = build_grader(
    {
        "type": "string_check",
        "name": "has_e",
        "operation": "like",
        "input": "{{sample.output_text}}",
        "reference": "{{item.answer}}",
    }
)
HAS_E_SET = RewardSet.of([HAS_E])
RL_KEYS = {
    "reward",
    "reward_std",
    "rewards/has_e/mean",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "clip_ratio",
    "entropy",
}


@pytest.fixture
def grpo_config(tiny_model_path: Path, tmp_path: Path) -> Callable[..., GRPOConfig]:
    def make(**overrides: Any) -> GRPOConfig:
        fields: dict[str, Any] = {
            "model_path": str(tiny_model_path),
            "output_dir": str(tmp_path / "out"),
            "batch_size": 4,
            "num_generations": 4,
            "max_completion_length": 4,
            "lr_scheduler": "constant",
        }
        return GRPOConfig(**(fields | overrides))

    return make


# -- the loss of the batch the loop really builds, against TRL ----------------------------------------------
class StepSpy(GroupRollouts):
    """The real preparer, keeping each step's batches and a copy of the model they were trained on."""

    steps: ClassVar[list[tuple[PreparedStep[GRPOBatch], torch.nn.Module]]] = []

    def prepare(
        self, model: torch.nn.Module, examples: list[Sequence[RLPrompt]], repeat: int
    ) -> PreparedStep[GRPOBatch]:
        step = super().prepare(model, examples, repeat)
        StepSpy.steps.append((step, copy.deepcopy(model)))
        return step


def _pad_cat(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    return torch.cat([torch.nn.functional.pad(r, (0, width - r.size(1))) for r in rows])


# Every loss type and every reward scaling, each loss type once on a fresh rollout (π_old = π) and once
# over two steps on one rollout: then π_old is the first step's policy, so ratios leave 1 and clip, the
# KL to the base counts, and truncated completions are masked out of the loss. (The scaling and the
# loss type act on different tensors, so their pairs need not all be run.)
TWO_STEPS: dict[str, Any] = {
    "num_iterations": 2,
    "beta": 0.04,
    "epsilon_high": 0.28,
    "mask_truncated_completions": True,
}
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("grpo", "group", {}),
    ("grpo", "none", TWO_STEPS),
    ("dr_grpo", "batch", {}),
    ("dr_grpo", "group", TWO_STEPS),
    ("dapo", "none", {}),
    ("dapo", "batch", TWO_STEPS),
]


@pytest.mark.parametrize(("loss_type", "scale", "extra"), CASES)
def test_training_steps_equal_trl_on_the_loops_batches(
    grpo_config: Callable[..., GRPOConfig],
    eos_model_path: Path,
    tokenizer: PreTrainedTokenizerBase,
    monkeypatch: pytest.MonkeyPatch,
    loss_type: str,
    scale: str,
    extra: dict[str, Any],
) -> None:
    """A real run's step rows (loss, grad norm, clip ratio, kl, reward) equal TRL's `_compute_loss` on
    the same step's completions as one batch, with hand-set rewards and TRL's advantage code: the loop's
    accumulation over micro-batches and each loss type's denominator are what is checked here."""
    given: list[float] = []

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        given[:] = [float((3 * i) % 5) for i in range(len(completions))]
        return given

    monkeypatch.setattr(StepSpy, "steps", [])
    monkeypatch.setattr(trainers.methods.grpo, "GroupRollouts", StepSpy)
    steps = extra.get("num_iterations", 1)
    config = grpo_config(
        model_path=str(eos_model_path),
        use_lora=False,
        batch_size=2,
        gradient_accumulation_steps=2,  # two micro-batches of 2 prompts x 4 completions
        max_completion_length=6,
        learning_rate=1e-4,  # step 2 moves off π_old by a few clip ranges, not by orders of magnitude
        max_steps=steps,
        loss_type=loss_type,
        scale_rewards=scale,
        **extra,
    )
    rec = Recorder()
    train_grpo(config, ROWS, callbacks=rec, rewards=RewardSet.of([reward]))
    assert len(StepSpy.steps) == len(rec.steps) == steps
    base = AutoModelForCausalLM.from_pretrained(eos_model_path)
    first_policy = StepSpy.steps[0][1]
    eos = tokenizer.eos_token_id
    for (prepared, policy), row in zip(StepSpy.steps, rec.steps, strict=True):
        batches = prepared.batches
        assert len(batches) == 2
        width = max(b.completion_ids.size(1) for b in batches)
        logps, old, ref, masks, truncated = [], [], [], [], []
        for b in batches:
            mask, cut = completion_mask_from_eos(b.completion_ids, eos)
            args = (b.prompt_ids, b.prompt_mask, b.completion_ids, mask)
            logps.append(completion_logps(policy, *args)[0])
            with torch.no_grad():
                old.append(completion_logps(first_policy, *args)[0] if steps > 1 else logps[-1].detach())
                ref.append(completion_logps(base, *args)[0])
            masks.append(mask * (~cut).long().unsqueeze(1) if config.mask_truncated_completions else mask)
            truncated.append(cut)
        lengths = torch.cat([m.sum(dim=1) for m in masks])
        assert len(set(lengths.tolist())) > 2 and torch.cat(truncated).any()  # normalisations differ
        theirs, trl_metrics = trl_grpo_loss(
            _pad_cat(logps, width),
            _pad_cat(old, width),
            _pad_cat(ref, width),
            trl_group_advantages(torch.tensor(given), config.num_generations, scale),
            _pad_cat(masks, width),
            loss_type=loss_type,
            beta=config.beta,
            epsilon=config.epsilon,
            epsilon_high=config.epsilon_high or config.epsilon,
            max_len=config.max_completion_length,
        )
        assert row["loss"] == pytest.approx(theirs.item(), rel=1e-5, abs=1e-6)
        theirs.backward()  # type: ignore[no-untyped-call]
        grads = [p.grad for p in policy.parameters() if p.grad is not None]
        assert row["grad_norm"] == pytest.approx(
            float(torch.cat([g.flatten() for g in grads]).norm()), rel=1e-4
        )
        assert row["clip_ratio"] == pytest.approx(trl_metrics["clip_ratio/region_mean"][0], abs=1e-6)
        assert row["reward"] == pytest.approx(sum(given) / len(given))
        if config.beta:
            # relative as for the loss: a KL of ~6 carries fp32's rounding of ~6 in its last digits
            assert row["kl"] == pytest.approx(trl_metrics["kl"][0], rel=1e-5, abs=1e-6)
    if steps > 1:
        assert rec.steps[-1]["clip_ratio"] > 0 and rec.steps[-1]["kl"] > 0


# -- rollouts -----------------------------------------------------------------------------------------------
def test_rollout_masks_truncation_seeding_and_columns(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    rows: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": "Capital of Peru?"}], "answer": "Lima"},
        {"prompt": "Hi"},
    ]
    # a file has one shape (trainers.formats, as the upload validator says): each shape from its own file
    prompts = [p for row in rows for p in tokenize_rl_rows([row], tokenizer, max_prompt_length=64)]
    with pytest.raises(DataError, match="line 2: every row must have the messages format of line 1"):
        tokenize_rl_rows(rows, tokenizer, max_prompt_length=64)
    assert prompts[0].text.endswith("<|assistant|>\n") and prompts[1].text == "<|begin|>Hi"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    # Make EOS likely so that some completions stop early.
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = model.lm_head.weight[tokenizer.eos_token_id] + 0.8
    kw: dict[str, Any] = {"num_generations": 8, "max_completion_length": 12, "seed": 3}
    rollout = generate_rollout(model, tokenizer, prompts, **kw)
    again = generate_rollout(model, tokenizer, prompts, **kw)
    assert torch.equal(rollout.completion_ids, again.completion_ids)
    other = generate_rollout(model, tokenizer, prompts, **(kw | {"seed": 4}))
    assert not torch.equal(rollout.completion_ids, other.completion_ids)
    assert rollout.columns == {"answer": ["Lima"] * 8 + [None] * 8}
    assert rollout.prompts == [prompts[0].text] * 8 + [prompts[1].text] * 8
    eos = tokenizer.eos_token_id
    stopped = 0
    for ids, mask, truncated in zip(
        rollout.completion_ids, rollout.completion_mask, rollout.truncated, strict=True
    ):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()
        assert bool(truncated) == (eos not in ids[:n].tolist())
        if not truncated:
            stopped += 1
            assert ids[n - 1] == eos and eos not in ids[: n - 1].tolist()
    assert 0 < stopped < 16
    assert rollout.completions[0] == tokenizer.decode(rollout.completion_ids[0], skip_special_tokens=True)
    # Log-probs of a left-padded batch equal those of each sequence alone.
    logps, _ = completion_logps(
        model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask
    )
    i = 8  # the shorter prompt: left-padded
    n = int(rollout.completion_mask[i].sum())
    ids = torch.tensor([prompts[1].input_ids + rollout.completion_ids[i, :n].tolist()])
    p = len(prompts[1].input_ids)
    with torch.no_grad():
        alone = model(input_ids=ids).logits[0].log_softmax(-1)[p - 1 : p - 1 + n].gather(-1, ids[0, p:, None])
    assert torch.allclose(logps[i, :n], alone.squeeze(-1), atol=1e-5)


def test_rollouts_give_the_head_contiguous_inputs(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """``generate``'s first step applies the head to a strided view (each row's last position), which
    the CPU runs as a batched product against a copy of the head per row (trainers/families/rollout.py)."""
    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    seen: list[tuple[tuple[int, ...], bool]] = []
    model.lm_head.register_forward_hook(
        lambda _head, args, _out: seen.append((tuple(args[0].shape), args[0].is_contiguous()))
    )
    prompts = tokenize_rl_rows(
        [{"prompt": "Hi"}, {"prompt": "Capital of Peru?"}], tokenizer, max_prompt_length=64
    )
    generate_rollout(model, tokenizer, prompts, num_generations=2, max_completion_length=3, seed=0)
    assert seen[0] == ((4, 1, 64), True)  # the prompt's step, where the view is strided
    assert all(contiguous for _, contiguous in seen)
    seen.clear()
    with torch.no_grad():
        model.lm_head(torch.zeros(4, 6, 64)[:, -1:, :])
    assert seen == [((4, 1, 64), False)]  # the hook is gone afterwards


# -- training -----------------------------------------------------------------------------------------------
def test_grpo_reward_rises(grpo_config: Callable[..., GRPOConfig]) -> None:
    rec = Recorder()
    config = grpo_config(use_lora=False, learning_rate=1e-2, max_steps=16, n_epochs=4)
    result = train_grpo(config, ROWS, callbacks=rec, rewards=HAS_E_SET)
    rewards = [r["reward"] for r in rec.steps]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.25, rewards
    assert rewards[-1] >= 0.9
    assert all(set(r) >= RL_KEYS for r in rec.steps)
    assert rec.steps[0]["completions/max_length"] == 4.0
    assert result.final_checkpoint is not None and result.final_checkpoint.final
    model = AutoModelForCausalLM.from_pretrained(result.final_checkpoint.path / "model")
    assert model.config.architectures == ["LlamaForCausalLM"]


def _base_weight_copies(vocab_rows: int) -> int:
    """Distinct storages of [vocab, hidden] tensors alive: the embedding and LM head of each model copy."""
    gc.collect()
    ptrs = {
        obj.untyped_storage().data_ptr()
        for obj in gc.get_objects()
        # type(), not isinstance(): isinstance reads __class__, which warns on some torch proxies
        if issubclass(type(obj), torch.Tensor) and obj.dim() == 2 and obj.shape == (vocab_rows, 64)
    }
    return len(ptrs)


class CopyCounter(Recorder):
    """Counts the [vocab, hidden] tensors that training adds to those alive before it (earlier tests')."""

    def __init__(self, vocab_rows: int) -> None:
        super().__init__()
        self.vocab_rows, self.copies = vocab_rows, 0
        self.before = _base_weight_copies(vocab_rows)

    def on_step(self, row: dict[str, float]) -> None:
        super().on_step(row)
        self.copies = max(self.copies, _base_weight_copies(self.vocab_rows) - self.before)


@pytest.mark.parametrize(("use_lora", "copies"), [(True, 2), (False, 8)], ids=["lora", "full"])
def test_kl_reference_holds_one_base_copy_with_lora(
    grpo_config: Callable[..., GRPOConfig], tokenizer: PreTrainedTokenizerBase, use_lora: bool, copies: int
) -> None:
    rec = CopyCounter(len(tokenizer))
    config = grpo_config(use_lora=use_lora, beta=0.1, learning_rate=1e-2, max_steps=3)
    train_grpo(config, ROWS, callbacks=rec, rewards=HAS_E_SET)
    # The tiny Llama's embedding and LM head are untied: two [vocab, hidden] tensors per copy. LoRA: the
    # base alone. Full training: the policy, AdamW's two moments of each, and the frozen reference.
    assert rec.copies == copies
    assert rec.steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    assert rec.steps[-1]["kl"] > 0.0


RESUME: dict[str, Any] = {
    "max_steps": 6,
    "save_steps": 3,
    "num_iterations": 2,  # step 3 is mid-rollout: the checkpoint carries the rollout in use
    "beta": 0.05,
    "lora_dropout": 0.1,
    "learning_rate": 2e-2,
    "warmup_ratio": 0.2,
    "lr_scheduler": "cosine",
    "loss_type": "dapo",
    "epsilon_high": 0.28,
    "seed": 5,
}


def test_resume_repeats_the_uninterrupted_run(grpo_config: Callable[..., GRPOConfig], tmp_path: Path) -> None:
    full = Recorder()
    train_grpo(
        grpo_config(**RESUME, output_dir=str(tmp_path / "a")),
        ROWS,
        callbacks=full,
        rewards=HAS_E_SET,
    )
    assert [(c.step, c.final) for c in full.checkpoints] == [(3, False), (6, True)]
    resumed = Recorder()
    config = grpo_config(**RESUME, output_dir=str(tmp_path / "b"), resume_from=str(full.checkpoints[0].path))
    train_grpo(config, ROWS, callbacks=resumed, rewards=HAS_E_SET)
    assert [int(r["step"]) for r in resumed.steps] == [4, 5, 6]
    for ours, theirs in zip(resumed.steps, full.steps[3:], strict=True):
        for key in ("loss", "reward", "kl", "clip_ratio", "grad_norm", "learning_rate", "epoch"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-6), key
    assert full.steps[2]["reward"] == full.steps[3]["reward"]  # steps 3 and 4 share a rollout


def test_cancel_stops_without_a_checkpoint(grpo_config: Callable[..., GRPOConfig]) -> None:
    rec = Recorder(stop_after={2: StopRequest.CANCEL})
    result = train_grpo(grpo_config(max_steps=10, save_steps=5), ROWS, callbacks=rec, rewards=HAS_E_SET)
    assert result.stopped is StopRequest.CANCEL and result.steps == 2
    assert result.final_checkpoint is None and rec.checkpoints == []
