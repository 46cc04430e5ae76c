"""Packed pair batches (``trainers.data.packing``): the 2B rows of a preference batch run through the decoder
packed into fewer rows, as sequences or with each pair's prompt once, and every completion log-prob,
reward score and gradient equals the right-padded forward's; the DPO and reward-model runs pack their
batches and train as they do padded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerBase

from tests.trainers.helpers import Recorder, assert_packed_trains_as_padded
from trainers.data.packing import PackedLayout, PairPacking, pack_layout, shared_prompt_layout
from trainers.data.preference import PreferenceBatch, collate_preferences, tokenize_preference_rows
from trainers.methods.dpo import DPOConfig, train_dpo
from trainers.methods.reward_model import RewardModelConfig, train_reward_model
from trainers.modeling import loading as modeling
from trainers.modeling.loading import pair_packing, reward_scores, runs_packed, target_log_probs

# pairs of very different lengths, so that packing puts several sequences in one row
UNEVEN_ROWS = [
    {"prompt": "Q: What is the capital of France?\nA:", "chosen": " Paris.", "rejected": " Lyon, I think."},
    {"prompt": "Tell me more.", "chosen": " The robot read books all night long.", "rejected": " No."},
    {
        "prompt": "Name a city in Japan, and say why.",
        "chosen": " Tokyo.",
        "rejected": " Kyoto, it has temples.",
    },
    {"prompt": "Hi", "chosen": " Hello there, how can I help you today?", "rejected": " Bye."},
]


def test_pack_layout_bins_rows_and_round_trips() -> None:
    # best-fit decreasing into rows of 6: [row 1] and [row 0, row 2]; positions restart per sequence
    layout = pack_layout([3, 5, 2], width=5, capacity=6)
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    padded = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 6, 7, 8], [9, 10, 0, 0, 0]])
    assert layout.pack(padded, fill=-1).tolist() == [[4, 5, 6, 7, 8], [1, 2, 3, 9, 10]]
    real = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]).bool()
    hidden = torch.randn(3, 5, 4) * real[..., None]
    packed_hidden = torch.stack([layout.pack(hidden[..., k]) for k in range(4)], dim=-1)
    assert torch.equal(layout.unpack(packed_hidden), hidden)
    # a padded tail restarts its positions: a sequence of its own that no real token attends to
    assert pack_layout([2, 1], width=2, capacity=4).position_ids.tolist() == [[0, 1, 0]]
    with pytest.raises(ValueError, match="1 to 2 tokens"):
        pack_layout([0, 2], width=2, capacity=4)


PACKINGS = [PairPacking.SEQUENCES, PairPacking.SHARED_PROMPTS]


def test_shared_prompt_layout_runs_each_prompt_once() -> None:
    # pairs (prompt, chosen, rejected) of (2, 1, 1) and (1, 2, 1) tokens; the 2B rows padded to 3
    layout = shared_prompt_layout([2, 1], [(1, 1), (2, 1)], [(0, 2), (1, 3)], width=3)
    chosen_rows, rejected_rows = [[1, 2, 3], [6, 7, 8]], [[1, 2, 4], [6, 9, 0]]
    padded = torch.tensor(chosen_rows + rejected_rows)
    assert layout.pack(padded, fill=-1).tolist() == [[1, 2, 3, 4], [6, 7, 8, 9]]
    # the rejected tokens' positions continue from the prompt, not from the chosen ones
    assert layout.position_ids.tolist() == [[0, 1, 2, 2], [0, 1, 2, 1]]
    # each completion sees its prompt and itself; the rejected one never sees the chosen
    assert layout.attention is not None
    assert layout.attention[:, 0].int().tolist() == [
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]],
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]],
    ]
    # unpacking gives each row its prompt's slots: the shared prompt reaches both rows of a pair
    real = padded != 0
    assert torch.equal(layout.unpack(layout.pack(padded)[..., None])[..., 0], padded * real)
    # short pairs share a row (up to the longest pair or the rows' width); the padded tail is its own
    wide = shared_prompt_layout([1, 1, 1], [(1, 1), (1, 1), (2, 1)], [(0, 3), (1, 4), (2, 5)], width=6)
    assert wide.position_ids.tolist() == [[0, 1, 2, 1, 0, 1], [0, 1, 1, 0, 1, 1]]
    assert wide.attention is not None
    assert wide.attention[0, 0, 4:, :4].sum() == 0 and wide.attention[1, 0, 3:, :3].sum() == 0
    with pytest.raises(ValueError, match="a prompt token"):
        shared_prompt_layout([0], [(1, 1)], [(0, 1)], width=2)
    with pytest.raises(ValueError, match="each row in one group"):
        shared_prompt_layout([1], [(1, 1)], [(0, 0)], width=2)


def _batch(
    tokenizer: PreTrainedTokenizerBase, pack: PairPacking, pad_token_id: int | None = None
) -> PreferenceBatch:
    examples = tokenize_preference_rows(UNEVEN_ROWS, tokenizer, max_length=64)
    pad_id = tokenizer.pad_token_id if pad_token_id is None else pad_token_id
    return collate_preferences(list(examples), pad_token_id=pad_id, pack=pack)


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def _running_positions(layout: PackedLayout) -> PackedLayout:
    """The control: the same rows with positions running on through each row and plain causal attention,
    so sequences (a rejected completion and its chosen one too) see each other."""
    rows, width = layout.packed_shape
    return PackedLayout(layout.padded_shape, layout.slot_of, torch.arange(width).repeat(rows, 1))


@pytest.mark.parametrize("packing", PACKINGS)
def test_packed_log_probs_and_gradients_equal_padded(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase, packing: PairPacking
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    padded, packed = _batch(tokenizer, PairPacking.PADDED), _batch(tokenizer, packing)
    assert packed.packed is not None and packed.packed.packed_shape[0] < padded.input_ids.shape[0]
    mask = padded.completion_mask
    weights = torch.linspace(0.5, 2.0, int(mask[:, 1:].sum()))  # a different upstream gradient per token

    expected = target_log_probs(model, padded.input_ids, padded.attention_mask, mask)
    (expected * weights).sum().backward()
    expected_grads = _gradients(model)
    ours = target_log_probs(model, packed.input_ids, packed.attention_mask, mask, packed=packed.packed)
    (ours * weights).sum().backward()
    assert torch.allclose(ours, expected, atol=1e-5)
    for name, grad in _gradients(model).items():
        assert torch.allclose(grad, expected_grads[name], atol=1e-5), name

    with torch.no_grad():
        crossed = _running_positions(packed.packed)
        control = target_log_probs(model, packed.input_ids, packed.attention_mask, mask, packed=crossed)
    assert not torch.allclose(control, expected, atol=1e-3)


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("pad", ["pad", "eos"])
def test_packed_reward_scores_and_gradients_equal_padded(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase, pad: str, packing: PairPacking
) -> None:
    """With pad = EOS too (``load_tokenizer``'s choice for a tokenizer without a pad token): transformers'
    classifier then scores the rightmost token that is not EOS, and so must the packed forward."""
    pad_id = tokenizer.pad_token_id if pad == "pad" else tokenizer.eos_token_id
    assert pad == "pad" or pad_id != tokenizer.pad_token_id
    torch.manual_seed(0)  # the score head is initialised at random
    model = AutoModelForSequenceClassification.from_pretrained(
        tiny_model_path, num_labels=1, pad_token_id=pad_id, dtype=torch.float32
    )
    padded, packed = _batch(tokenizer, PairPacking.PADDED, pad_id), _batch(tokenizer, packing, pad_id)
    assert packed.packed is not None and packed.packed.packed_shape[0] < padded.input_ids.shape[0]
    weights = torch.linspace(0.5, 2.0, padded.input_ids.shape[0])

    expected = reward_scores(model, padded.input_ids, padded.attention_mask)
    (expected * weights).sum().backward()
    expected_grads = _gradients(model)
    ours = reward_scores(model, packed.input_ids, packed.attention_mask, packed=packed.packed)
    (ours * weights).sum().backward()
    assert torch.allclose(ours, expected, atol=1e-5)
    grads = _gradients(model)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, expected_grads[name], atol=1e-5), name

    with torch.no_grad():
        crossed = _running_positions(packed.packed)
        control = reward_scores(model, packed.input_ids, packed.attention_mask, packed=crossed)
    assert not torch.allclose(control, expected, atol=1e-3)


def test_every_layer_shares_one_attention_mask_on_the_cpu(
    tiny_model_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """sdpa's CPU kernel would convert a boolean mask to a float copy in every layer and keep each copy
    for backward; the layout hands it the float mask itself, once."""
    layout = _batch(tokenizer, PairPacking.SHARED_PROMPTS).packed
    assert layout is not None and layout.attention is not None
    additive = layout.attention_mask()
    assert additive is not None and additive.dtype == torch.float32
    assert torch.equal(additive == 0, layout.attention)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    batch = _batch(tokenizer, PairPacking.SHARED_PROMPTS)
    masks: set[int] = set()

    def keep(saved: torch.Tensor) -> torch.Tensor:
        if saved.shape == layout.attention.shape:
            masks.add(saved.untyped_storage().data_ptr())
        return saved

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda saved: saved):
        modeling.decoder_hidden_states(model.model, batch.input_ids, batch.attention_mask, layout)
    assert len(masks) == 1 and model.config.num_hidden_layers > 1


def test_packing_is_for_the_decoders_that_run_alone(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert runs_packed(model)
    assert pair_packing(model) is PairPacking.SHARED_PROMPTS  # sdpa takes the layout's boolean mask
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="eager")
    assert runs_packed(eager) and pair_packing(eager) is PairPacking.SEQUENCES  # eager would add it
    monkeypatch.setattr(modeling, "PLAIN_HEAD_MODELS", frozenset())  # an architecture it does not know
    assert not runs_packed(model)
    assert pair_packing(model) is PairPacking.PADDED


@pytest.mark.parametrize(
    ("train", "make_config"),
    [(train_dpo, DPOConfig), (train_reward_model, RewardModelConfig)],
    ids=["dpo", "reward_model"],
)
def test_a_packed_run_trains_as_a_padded_one(
    tiny_model_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    train: Callable[..., Any],
    make_config: Callable[..., Any],
) -> None:
    def run(name: str, recorder: Recorder) -> None:
        config = make_config(
            model_path=str(tiny_model_path),
            output_dir=str(tmp_path / name),
            batch_size=4,
            max_steps=3,
            mixed_precision="no",
        )
        train(config, UNEVEN_ROWS * 3, callbacks=recorder)

    assert_packed_trains_as_padded(run, ("loss", "grad_norm", "trained_tokens"), monkeypatch)
