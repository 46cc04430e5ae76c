"""trainers.core.loop's bookkeeping, on the tiny model: how many steps a run has (epochs, accumulation, reused
rollouts, max_steps, a resumed position), the warmup it lays over them, what cancel and pause hand
back, the extra module it trains, and the mixed-precision plumbing.

The loop's arithmetic is checked against an independent enumeration of a run's steps, not against
the formula it uses. bf16 autocast is real on the CPU; fp16 is CUDA's only (``precision.autocast_dtype``
answers None for it on a CPU), so its test replaces that one decision to run the loop's fp16 branch on
the CPU: a stand-in for the GPU this suite does not have; the branch itself is the real code.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerBase

import trainers.core.loop as loop
from tests.trainers.helpers import Recorder
from trainers.core import distributed
from trainers.core.checkpoint import LoopState, checkpoint_dir
from trainers.core.loop import LossSums, PreparedStep, StopRequest, TrainingTask, run_training
from trainers.core.schedule import lr_multiplier
from trainers.data.collate import SFTBatch, pad_batch
from trainers.data.sft import TokenizedExample, tokenize_sft_rows
from trainers.families.entry import load_model_to_train
from trainers.methods.sft import SFTConfig, sft_loss

CPU = torch.device("cpu")


class RepeatingPreparer:
    """A stand-in for a rollout: trains on each group of examples ``steps_per_rollout`` times."""

    def __init__(self, collate: Callable[[Sequence[TokenizedExample]], SFTBatch], repeats: int) -> None:
        self.collate, self.steps_per_rollout = collate, repeats
        self.calls: list[tuple[int, int]] = []  # (micro-batches, repeat)

    def prepare(
        self, model: torch.nn.Module, examples: list[Sequence[TokenizedExample]], repeat: int
    ) -> PreparedStep[SFTBatch]:
        self.calls.append((len(examples), repeat))
        return PreparedStep([self.collate(e) for e in examples], {"repeat": float(repeat)})

    def state_dict(self) -> dict[str, Any]:
        return {"calls": len(self.calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _task(
    config: SFTConfig,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    *,
    repeats: int = 1,
    loss_fn: Callable[[torch.nn.Module, SFTBatch], LossSums] = sft_loss,
    extra: torch.nn.Module | None = None,
) -> TrainingTask[TokenizedExample, SFTBatch]:
    examples = tokenize_sft_rows(rows, tokenizer, max_length=64)
    collate = partial(pad_batch, pad_token_id=tokenizer.pad_token_id)
    preparer = RepeatingPreparer(collate, repeats) if repeats > 1 else None
    model = load_model_to_train(config, CPU)
    return TrainingTask(
        model, tokenizer, examples, collate, loss_fn, preparer=preparer, extra_trainable=extra
    )


def schedule(n: int, batch: int, accum: int, epochs: int, repeats: int) -> list[tuple[int, int, int]]:
    """Every optimizer step of a run, in order, as (epoch, first micro-batch, repeat): enumerated."""
    micro = math.ceil(n / batch)
    return [
        (epoch, start, repeat)
        for epoch in range(epochs)
        for start in range(0, micro, accum)
        for repeat in range(repeats)
    ]


@pytest.mark.parametrize(
    ("n_rows", "batch_size", "accum", "epochs", "max_steps", "repeats"),
    [
        (10, 3, 2, 1, None, 1),  # 4 micro-batches, 2 steps
        (10, 3, 2, 3, None, 1),  # 3 epochs
        (7, 2, 3, 2, None, 2),  # an epoch's last step has 1 micro-batch of 3; each group trained twice
        (10, 3, 1, 2, None, 3),
        (10, 3, 2, 3, 5, 1),  # max_steps cuts the run short
    ],
)
def test_a_run_has_the_steps_its_data_epochs_and_repeats_make(
    make_config: Callable[..., SFTConfig],
    tokenizer: PreTrainedTokenizerBase,
    demo_rows: list[dict[str, Any]],
    n_rows: int,
    batch_size: int,
    accum: int,
    epochs: int,
    max_steps: int | None,
    repeats: int,
) -> None:
    config = make_config(
        batch_size=batch_size,
        gradient_accumulation_steps=accum,
        n_epochs=epochs,
        max_steps=max_steps,
        save_minutes=0,
    )
    task = _task(config, tokenizer, demo_rows[:n_rows], repeats=repeats)
    rec = Recorder()
    result = run_training(config, task, rec)
    steps = schedule(n_rows, batch_size, accum, epochs, repeats)[:max_steps]
    assert rec.begin == {"total_steps": len(steps), "n_epochs": epochs}
    assert len(rec.steps) == result.steps == len(steps)
    assert [row["total_steps"] for row in rec.steps] == [len(steps)] * len(steps)
    # an epoch ends after its last step (not after a step that merely reuses a rollout)
    full = schedule(n_rows, batch_size, accum, epochs, repeats)
    ends = [
        (epoch + 1, i + 1)
        for i, (epoch, _, _) in enumerate(steps)
        if i + 1 == len(full) or full[i + 1][0] != epoch
    ]
    assert rec.epochs == ends
    if task.preparer is not None:
        micro = math.ceil(n_rows / batch_size)
        expected = [(min(accum, micro - start), repeat) for _, start, repeat in steps]
        assert task.preparer.calls == expected  # type: ignore[attr-defined]
        assert [row["repeat"] for row in rec.steps] == [float(r) for _, _, r in steps]


@pytest.mark.parametrize("at", [(0, 0, 0, 0), (3, 1, 2, 1), (5, 1, 2, 2), (8, 2, 2, 0), (26, 2, 2, 2)])
def test_a_resumed_position_counts_the_steps_left_from_it(
    make_config: Callable[..., SFTConfig],
    tokenizer: PreTrainedTokenizerBase,
    demo_rows: list[dict[str, Any]],
    at: tuple[int, int, int, int],
) -> None:
    """10 rows of 2 a micro-batch, 2 micro-batches a step, 3 uses of each group, 3 epochs: from a state
    (step, epoch, next micro-batch, repeat) the total is that step plus the schedule's steps left."""
    step, epoch, batch_index, repeat = at
    config = make_config(batch_size=2, gradient_accumulation_steps=2, n_epochs=3)
    run = _Loop(config, _task(config, tokenizer, demo_rows[:10], repeats=3))
    steps = schedule(10, 2, 2, 3, 3)
    left = [s for s in steps if s >= (epoch, batch_index, repeat)]
    assert run._total_steps(
        LoopState(step=step, epoch=epoch, batch_index=batch_index, repeat=repeat)
    ) == step + len(left)


def _Loop(config: SFTConfig, task: TrainingTask[TokenizedExample, SFTBatch]) -> Any:
    return loop._Loop(config, task, Recorder())


def test_warmup_is_its_share_of_the_run(
    make_config: Callable[..., SFTConfig], tokenizer: PreTrainedTokenizerBase, demo_rows: list[dict[str, Any]]
) -> None:
    config = make_config(
        batch_size=2, n_epochs=1, warmup_ratio=0.3, lr_scheduler="linear", learning_rate=1e-3, save_minutes=0
    )
    rec = Recorder()
    run_training(config, _task(config, tokenizer, demo_rows[:14]), rec)
    total = len(rec.steps)
    assert total == 7
    warmup = math.ceil(0.3 * total)  # 3 steps
    expected = [
        1e-3 * lr_multiplier(s, kind="linear", warmup_steps=warmup, total_steps=total) for s in range(total)
    ]
    assert [row["learning_rate"] for row in rec.steps] == pytest.approx(expected)


@pytest.mark.parametrize("stop", [StopRequest.CANCEL, StopRequest.PAUSE])
def test_cancel_and_pause_hand_back_the_last_steps_metrics(
    make_config: Callable[..., SFTConfig],
    tokenizer: PreTrainedTokenizerBase,
    demo_rows: list[dict[str, Any]],
    stop: StopRequest,
) -> None:
    config = make_config(batch_size=2, max_steps=6, save_minutes=0)
    rec = Recorder(stop_after={2: stop})
    result = run_training(config, _task(config, tokenizer, demo_rows[:12]), rec)
    assert result.stopped == stop and result.steps == 2 and len(rec.steps) == 2
    assert result.metrics == rec.steps[-1]
    if stop == StopRequest.PAUSE:
        assert (
            result.final_checkpoint is not None
            and result.final_checkpoint.step == 2
            and not result.final_checkpoint.final
        )
        assert (checkpoint_dir(config.output_dir, 2) / "state").is_dir()  # resumable
    else:
        assert result.final_checkpoint is None and rec.checkpoints == []


def test_a_step_spans_the_ranks(
    make_config: Callable[..., SFTConfig],
    tokenizer: PreTrainedTokenizerBase,
    demo_rows: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = make_config()
    offline, online = (_task(config, tokenizer, demo_rows[:4], repeats=r) for r in (1, 2))
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    for task in (offline, online):
        assert _Loop(config, task).group == config.gradient_accumulation_steps * 2


def test_an_extra_module_trains_with_the_model(
    make_config: Callable[..., SFTConfig], tokenizer: PreTrainedTokenizerBase, demo_rows: list[dict[str, Any]]
) -> None:
    """PPO's value head is the loop's ``extra_trainable``: in the optimizer, in train mode, updated."""
    head = torch.nn.Linear(4, 1)
    head.eval()
    before = head.weight.detach().clone()
    seen_training: list[bool] = []

    def loss_with_head(model: torch.nn.Module, batch: SFTBatch) -> LossSums:
        seen_training.append(head.training)
        out = sft_loss(model, batch)
        return LossSums(out.loss + head(torch.ones(4)).square().sum(), out.metrics)

    config = make_config(batch_size=4, max_steps=2, learning_rate=1e-2, save_minutes=0)
    run_training(
        config, _task(config, tokenizer, demo_rows[:8], loss_fn=loss_with_head, extra=head), Recorder()
    )
    assert seen_training == [True, True]
    assert not torch.equal(head.weight.detach(), before)


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_mixed_precision_autocasts_the_loss_and_scales_fp16(
    make_config: Callable[..., SFTConfig],
    tokenizer: PreTrainedTokenizerBase,
    demo_rows: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    precision: str,
    dtype: torch.dtype,
) -> None:
    """What ``mixed_precision`` makes the loop do (fp16's answer stubbed, see the module docstring):
    every loss runs under autocast in that dtype; fp16 alone gets a gradient scaler, whose state is
    checkpointed and restored on resume (a skipped step's reduced scale carries over)."""
    if dtype == torch.float16:
        monkeypatch.setattr(loop, "autocast_dtype", lambda precision, device: dtype)
    autocast: list[tuple[bool, torch.dtype]] = []
    overflow_at = {2}  # the loss of step 2 is made non-finite: fp16's scaler skips the step, halves its scale

    def recording_loss(model: torch.nn.Module, batch: SFTBatch) -> LossSums:
        autocast.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        out = sft_loss(model, batch)
        step = len(autocast)
        return LossSums(out.loss * (math.inf if step in overflow_at else 1.0), out.metrics)

    run = {"batch_size": 4, "max_steps": 4, "save_steps": 3, "mixed_precision": precision}
    config = make_config(**run)
    task = _task(config, tokenizer, demo_rows[:16], loss_fn=recording_loss)
    rec = Recorder()
    if dtype == torch.bfloat16:
        run_training(config, task, rec)
        assert autocast == [(True, torch.bfloat16)] * 4
        assert not (checkpoint_dir(config.output_dir, 3) / "state" / "scaler.pt").exists()
        return
    run_training(config, task, rec)
    assert autocast == [(True, torch.float16)] * 4
    saved = torch.load(checkpoint_dir(config.output_dir, 3) / "state" / "scaler.pt", weights_only=True)
    assert saved["scale"] == 2.0**15  # 2**16 halved once, at the overflowing step

    # resume from step 3 in a fresh loop: the scaler starts from the checkpoint's scale, not 2**16
    overflow_at.clear()
    resumed = make_config(
        **run, resume_from=str(checkpoint_dir(config.output_dir, 3)), output_dir=config.output_dir + "-r"
    )
    fresh = loop._Loop(resumed, _task(resumed, tokenizer, demo_rows[:16], loss_fn=recording_loss), Recorder())
    fresh.run()
    assert fresh.scaler is not None and fresh.scaler.get_scale() == 2.0**15


def test_step_rows_report_epoch_progress_metrics_and_throughput(
    make_config: Callable[..., SFTConfig], tokenizer: PreTrainedTokenizerBase, demo_rows: list[dict[str, Any]]
) -> None:
    """7 rows of 2 a micro-batch (4 micro-batches), 3 a step, each group trained twice: the epoch column
    advances by each step's share of the examples; a metric is averaged over the step's loss units, or
    over its own units where it has them; tokens/s is the step's tokens over at most the run's time."""

    def counting_loss(model: torch.nn.Module, batch: SFTBatch) -> LossSums:
        out = sft_loss(model, batch)
        rows = float(batch.input_ids.shape[0])
        metrics: dict[str, float | torch.Tensor] = {
            "per_unit": float(batch.n_targets),
            "per_row": torch.tensor(2.0 * rows),
            "unseen": 0.0,  # a metric whose units sum to 0 in a step (KTO's side with no example in it)
        }
        return LossSums(out.loss, metrics, metric_units={"per_row": rows, "unseen": 0.0})

    config = make_config(batch_size=2, gradient_accumulation_steps=3, n_epochs=2, save_minutes=0)
    rec = Recorder()
    started = time.perf_counter()
    run_training(config, _task(config, tokenizer, demo_rows[:7], repeats=2, loss_fn=counting_loss), rec)
    wall = time.perf_counter() - started
    micro, expected_epochs = 4, []
    for epoch, start, repeat in schedule(7, 2, 3, 2, 2):
        group = min(3, micro - start)
        expected_epochs.append(epoch + (start + group * (repeat + 1) / 2) / micro)
    assert [row["epoch"] for row in rec.steps] == pytest.approx(expected_epochs)
    assert [row["per_unit"] for row in rec.steps] == pytest.approx([1.0] * len(rec.steps))
    assert [row["per_row"] for row in rec.steps] == pytest.approx([2.0] * len(rec.steps))
    assert not any("unseen" in row for row in rec.steps)  # left out, not divided by 0
    trained = [0.0] + [r["trained_tokens"] for r in rec.steps]
    tokens = [b - a for a, b in itertools.pairwise(trained)]
    for row, n in zip(rec.steps, tokens, strict=True):
        assert n > 0 and n / wall <= row["tokens_per_second"] < math.inf


def test_a_step_of_one_loss_unit_is_divided_by_one(
    make_config: Callable[..., SFTConfig], tokenizer: PreTrainedTokenizerBase
) -> None:
    example = TokenizedExample([5, 9, 7], [False, False, True])  # one target
    config = make_config(batch_size=1, max_steps=1, save_minutes=0)
    task = _task(config, tokenizer, [{"text": "x"}])
    task.train_data, task.valid_data = [example], [example]
    batch = pad_batch([example], pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        expected = sft_loss(task.model, batch).loss.item()
    model_before = copy.deepcopy(task.model)
    rec = Recorder()
    run_training(config, task, rec)
    assert rec.steps[0]["loss"] == pytest.approx(expected, rel=1e-6)
    with torch.no_grad():  # validated after the step, also over its one unit
        after = sft_loss(task.model, batch).loss.item()
    assert rec.evals[0]["valid_loss"] == pytest.approx(after, rel=1e-6)
    assert after != pytest.approx(sft_loss(model_before, batch).loss.item(), rel=1e-6)


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5, 1e-4])
def test_gradients_are_clipped_to_max_grad_norm_unless_it_is_zero(
    make_config: Callable[..., SFTConfig],
    tokenizer: PreTrainedTokenizerBase,
    demo_rows: list[dict[str, Any]],
    max_grad_norm: float,
) -> None:
    """SGD-like first AdamW step aside, clipping shows in the optimizer's first moment: it holds
    (1 - beta1) x the clipped gradient, whose norm is min(norm, max_grad_norm) (0: no clipping)."""
    # full fine-tuning: no randomly initialised adapter, so the gradient is the same in every test order
    config = make_config(
        batch_size=4, max_steps=1, save_minutes=0, max_grad_norm=max_grad_norm, use_lora=False
    )
    task = _task(config, tokenizer, demo_rows[:4])
    run = _Loop(config, task)
    rec = Recorder()
    run.cb = rec
    run.run()
    moments = [run.optimizer.state[p]["exp_avg"] for p in run.params]
    clipped = float(torch.linalg.vector_norm(torch.stack([m.norm() for m in moments]))) / 0.1
    norm = rec.steps[0]["grad_norm"]  # before clipping
    assert norm > 0.5
    assert clipped == pytest.approx(min(norm, max_grad_norm) if max_grad_norm > 0 else norm, rel=1e-4)


def test_validation_loss_covers_every_example_once(
    make_config: Callable[..., SFTConfig], tokenizer: PreTrainedTokenizerBase, demo_rows: list[dict[str, Any]]
) -> None:
    """Every step evaluated (``eval_steps`` 1), over 7 validation rows in chunks of 2: the loss over all
    their targets, as one padded batch gives it."""
    config = make_config(batch_size=2, max_steps=2, eval_steps=1, learning_rate=0.0, save_minutes=0)
    task = _task(config, tokenizer, demo_rows[:4])
    task.valid_data = tokenize_sft_rows(demo_rows[4:11], tokenizer, max_length=64)
    whole = pad_batch(list(task.valid_data), pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        out = sft_loss(task.model, whole)
    rec = Recorder()
    run_training(config, task, rec)  # learning rate 0: the model does not move
    assert [row["step"] for row in rec.evals] == [1.0, 2.0]
    for row in rec.evals:
        assert row["valid_loss"] == pytest.approx(out.loss.item() / whole.n_targets, rel=1e-5)
        assert row["valid_mean_token_accuracy"] == pytest.approx(
            float(out.metrics["mean_token_accuracy"]) / whole.n_targets
        )


def test_save_minutes_is_reached_exactly(
    make_config: Callable[..., SFTConfig],
    tokenizer: PreTrainedTokenizerBase,
    demo_rows: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps of 15 s of training time and ``save_minutes`` 0.5: a checkpoint after every second step,
    the one whose time reaches 30 s exactly; a pause right after one returns it instead of saving again."""
    now = [0.0]
    monkeypatch.setattr(loop, "clock", lambda: now[0])

    class Slow(Recorder):
        def on_step(self, row: dict[str, float]) -> None:
            super().on_step(row)
            now[0] += 15.0

    config = make_config(batch_size=1, max_steps=6, save_minutes=0.5)
    rec = Slow(stop_after={4: StopRequest.PAUSE})
    result = run_training(config, _task(config, tokenizer, demo_rows[:6]), rec)
    assert [(c.step, c.final) for c in rec.checkpoints] == [(2, False), (4, False)]
    assert result.final_checkpoint == rec.checkpoints[-1]


def test_a_checkpoint_that_does_not_fit_the_run_is_refused(
    make_config: Callable[..., SFTConfig], tokenizer: PreTrainedTokenizerBase, demo_rows: list[dict[str, Any]]
) -> None:
    config = make_config(batch_size=2, max_steps=1, save_steps=1)
    run_training(config, _task(config, tokenizer, demo_rows[:4]), Recorder())  # the final one is at step 1
    config = make_config(batch_size=2, max_steps=3, save_steps=1, output_dir=config.output_dir + "-2")
    run_training(config, _task(config, tokenizer, demo_rows[:4]), Recorder(stop_after={1: StopRequest.PAUSE}))
    ckpt = str(checkpoint_dir(config.output_dir, 1))
    other_data = make_config(batch_size=2, max_steps=3, resume_from=ckpt)
    with pytest.raises(ValueError, match=rf"^{ckpt}: the training data changed since this checkpoint$"):
        run_training(other_data, _task(other_data, tokenizer, demo_rows[:5]), Recorder())
    online = make_config(batch_size=2, max_steps=3, resume_from=ckpt)
    with pytest.raises(ValueError, match=rf"^{ckpt}: this checkpoint has no state for this method$"):
        run_training(online, _task(online, tokenizer, demo_rows[:4], repeats=2), Recorder())


def test_adamw_is_fused_and_decays_matrices_only(
    make_config: Callable[..., SFTConfig], tokenizer: PreTrainedTokenizerBase, demo_rows: list[dict[str, Any]]
) -> None:
    """Full fine-tuning, weight decay 0.1: the matrices decay, the 1-D norm scales do not (GPT-2 and Llama
    recipes), and the optimizer is torch's fused AdamW (one kernel over all parameters)."""
    config = make_config(use_lora=False, weight_decay=0.1)
    run = _Loop(config, _task(config, tokenizer, demo_rows[:4]))
    groups = run.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and all(p.ndim < 2 for p in groups[1]["params"])
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(run.params) > 0
    assert all(g["fused"] is True for g in groups)
    assert (
        loop._fusable([torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)]) is False
    )
    assert loop._fusable([]) is False


def test_a_run_resumed_with_a_larger_step_groups_the_rest_of_its_data(
    make_config: Callable[..., SFTConfig], tokenizer: PreTrainedTokenizerBase, demo_rows: list[dict[str, Any]]
) -> None:
    """As when a checkpoint of N ranks resumes on M: 10 rows, 5 micro-batches, paused after 2 one-micro-batch
    steps, resumed with 2 micro-batches a step: the 3 left make 2 more steps (4 in all, not the 3 a fresh
    run of that step size has), starting at the example where the first run stopped."""
    first = make_config(batch_size=2, gradient_accumulation_steps=1, save_minutes=0)
    run_training(first, _task(first, tokenizer, demo_rows[:10]), Recorder(stop_after={2: StopRequest.PAUSE}))
    ckpt = str(checkpoint_dir(first.output_dir, 2))
    resumed = make_config(
        batch_size=2, gradient_accumulation_steps=2, resume_from=ckpt, output_dir=first.output_dir + "-r"
    )
    rec = Recorder()
    run_training(resumed, _task(resumed, tokenizer, demo_rows[:10]), rec)
    assert rec.begin["total_steps"] == 4
    assert [row["step"] for row in rec.steps] == [3.0, 4.0]
    assert [row["epoch"] for row in rec.steps] == pytest.approx([4 / 5, 1.0])
