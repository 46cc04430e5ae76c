"""The online methods' completion log-probs on real tokens only
(``trainers.families.rollout.completion_layout``):
each row packed, or the prompt shared by consecutive rows run once, with the same log-probs, entropies
and gradients as the padded forward; GRPO trains on them as it does padded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.trainers.helpers import Recorder, assert_packed_trains_as_padded
from tests.trainers.methods.test_grpo import HAS_E_SET, ROWS
from trainers.families import rollout
from trainers.families.rollout import completion_layout, completion_logps, forward_completion, token_logps
from trainers.methods.grpo import GRPOConfig, train_grpo
from trainers.modeling import loading as modeling

# two groups of three rows that share a prompt (left-padded), then a row of its own; completions
# right-padded, one of them empty (a truncated completion that the loss masks)
PROMPT_IDS = torch.tensor([[0, 0, 5, 6, 7]] * 3 + [[9, 10, 11, 12, 13]] * 3 + [[0, 0, 0, 5, 6]])
PROMPT_MASK = (PROMPT_IDS != 0).long()
COMPLETION_MASK = torch.tensor(
    [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
)


def test_a_shared_prompt_runs_once_and_each_completion_continues_from_it() -> None:
    completions = torch.tensor([[20, 21], [22, 0], [23, 24]])
    prompts = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9]])
    packed = completion_layout(
        prompts, (prompts != 0).long(), completions, (completions != 0).long(), shared_prompts=True
    )
    # the first two rows' prompt 5, 6 once, then both completions, whose positions continue from it
    assert packed.input_ids.tolist() == [[5, 6, 20, 21, 22], [7, 8, 9, 23, 24]]
    assert packed.layout.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 3, 4]]
    assert packed.layout.attention is not None  # 22 sees its prompt and itself, not 20 and 21
    assert packed.layout.attention[0, 0, 4].tolist() == [True, True, False, False, True]
    # each completion token is predicted at the slot before it (the first at its prompt's last token);
    # 10, one past the last slot, where the row has no token
    assert packed.predicting.tolist() == [[1, 2], [1, 10], [7, 8]]
    alone = completion_layout(
        prompts, (prompts != 0).long(), completions, (completions != 0).long(), shared_prompts=False
    )
    # each row a sequence of its own: best-fit decreasing into rows of the longest (5)
    assert alone.input_ids.tolist() == [[7, 8, 9, 23, 24], [5, 6, 20, 21, 0], [5, 6, 22, 0, 0]]
    assert alone.layout.attention is None  # transformers derives it from the restarting positions
    assert alone.predicting.tolist() == [[6, 7], [11, 15], [2, 3]]


@pytest.mark.parametrize("shared", [True, False], ids=["shared_prompts", "sequences"])
def test_packed_log_probs_entropies_and_gradients_equal_padded(
    tiny_model_path: Path, shared: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    if not shared:  # the attention the layout would need (eager): each row a sequence of its own
        monkeypatch.setattr(rollout, "pair_packing", lambda _: modeling.PairPacking.SEQUENCES)
    layouts = []

    def recorded(*args: Any, shared_prompts: bool) -> Any:
        layouts.append(completion_layout(*args, shared_prompts=shared_prompts))
        return layouts[-1]

    monkeypatch.setattr(rollout, "completion_layout", recorded)
    completion_ids = torch.randint(3, 60, COMPLETION_MASK.shape, generator=torch.Generator().manual_seed(0))
    mask = COMPLETION_MASK.bool()
    weights = torch.linspace(0.5, 2.0, int(mask.sum()))  # a different upstream gradient per token

    out = forward_completion(model, PROMPT_IDS, PROMPT_MASK, completion_ids, COMPLETION_MASK)
    expected, expected_entropy = token_logps(out.logits, completion_ids, temperature=0.7)
    (expected[mask] * weights).sum().backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ours, entropy = completion_logps(
        model, PROMPT_IDS, PROMPT_MASK, completion_ids, COMPLETION_MASK, temperature=0.7
    )
    (ours[mask] * weights).sum().backward()
    # sdpa takes the shared prompts' mask: the 7 rows' prompts (3, 3, 3, 5, 5, 5, 2 tokens) run as 3
    assert layouts[0].input_ids.ne(0).sum() == int(COMPLETION_MASK.sum()) + (
        3 + 5 + 2 if shared else 3 * 3 + 3 * 5 + 2
    )
    torch.testing.assert_close(ours[mask], expected[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy[mask], expected_entropy[mask], rtol=0, atol=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_grpo_run_trains_on_packed_completions_as_on_padded_ones(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(name: str, recorder: Recorder) -> None:
        config = GRPOConfig(
            model_path=str(tiny_model_path),
            output_dir=str(tmp_path / name),
            batch_size=4,
            num_generations=4,
            max_completion_length=4,
            lr_scheduler="constant",
            learning_rate=2e-2,
            beta=0.04,
            max_steps=3,
            mixed_precision="no",
        )
        train_grpo(config, ROWS, callbacks=recorder, rewards=HAS_E_SET)

    keys = ("loss", "grad_norm", "kl", "entropy", "reward", "trained_tokens")
    assert_packed_trains_as_padded(run, keys, monkeypatch)
