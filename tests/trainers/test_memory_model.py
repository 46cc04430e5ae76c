"""The memory model (trainers/memory_model.py) against the trainer: its parameter counts against the
loaded model's, its precision rule against ``autocast_dtype``, its head chunk against the loss's, and its
peak against the peak measured on the tiny model (tests/trainers/peak_memory.py says how) within 25%
for LoRA and full fine-tuning, with and without gradient checkpointing. SmolLM2: bench/memory_estimate.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from service.jobs.estimate_schemas import MemoryBreakdown
from tests.trainers.peak_memory import measure_sft_peak, synthetic_rows
from trainers.core.precision import PRECISIONS, autocast_dtype
from trainers.families.entry import load_model_to_train
from trainers.losses import causal_lm
from trainers.memory_model import (
    HEAD_CHUNK_ELEMENTS,
    MemoryEstimate,
    ModelShape,
    TrainingShape,
    estimate_memory,
    lora_params,
    planned_steps,
    precision_bytes,
)
from trainers.methods.sft import SFTConfig

TOLERANCE = 0.25


def _shape(path: Path) -> ModelShape:
    return ModelShape.from_config(json.loads((path / "config.json").read_text(encoding="utf-8")))


def test_persistent_parts_are_the_trainers_tensors(tiny_model_path: Path) -> None:
    """Weights, gradients and AdamW state: byte for byte what the loaded model and its optimizer hold."""
    shape = _shape(tiny_model_path)
    for lora in (False, True):
        config = SFTConfig(str(tiny_model_path), "/nonexistent", use_lora=lora, lora_r=4)
        model = load_model_to_train(config, torch.device("cpu"))
        trainable = [p for p in model.parameters() if p.requires_grad]
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        if lora:
            assert sum(p.numel() for p in trainable) == lora_params(shape, TrainingShape(lora=True, lora_r=4))
            assert frozen == shape.n_params
        else:
            assert sum(p.numel() for p in trainable) == shape.n_params
        optimizer = torch.optim.AdamW(trainable, lr=1e-3)
        for p in trainable:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        moments = sum(t.nbytes for state in optimizer.state.values() for t in state.values() if t.dim() > 0)
        estimate = estimate_memory(shape, TrainingShape(lora=lora, lora_r=4))
        assert estimate.weights == sum(p.nbytes for p in model.parameters())
        assert estimate.gradients == sum(p.grad.nbytes for p in trainable if p.grad is not None)
        assert estimate.optimizer == moments


def test_constants_follow_the_trainer() -> None:
    assert HEAD_CHUNK_ELEMENTS == {"cpu": causal_lm.CHUNK_ELEMENTS, "cuda": causal_lm.CUDA_CHUNK_ELEMENTS}
    for precision in PRECISIONS:
        dtype = autocast_dtype(precision, torch.device("cpu"))
        expected = 4 if dtype is None else torch.finfo(dtype).bits // 8
        assert precision_bytes(precision, "cpu")[0] == expected, precision
    assert precision_bytes("auto", "cuda") == (2, 2)
    assert precision_bytes("fp16", "cuda") == (2, 4)  # a LoRA base stays fp32 under fp16


def test_the_apis_breakdown_is_the_estimate_part_for_part() -> None:
    estimate = MemoryEstimate(weights=1, gradients=2, optimizer=3, activations=4, logits=5, reference=6)
    parts = estimate.as_dict()
    assert parts["total"] == 21
    # the same names in the same order: the API's model is written out by hand (its docstring says why)
    assert list(MemoryBreakdown.model_fields) == list(parts)
    assert MemoryBreakdown(**parts).model_dump() == parts


def test_planned_steps() -> None:
    # 10 examples, micro-batches of 3 -> 4 a epoch; 2 per step over 1 rank -> 2 steps, x 3 epochs
    assert planned_steps(examples=10, batch_size=3, accumulation=2, ranks=1, epochs=3, max_steps=None) == 6
    assert planned_steps(examples=10, batch_size=3, accumulation=1, ranks=2, epochs=1, max_steps=None) == 2
    assert planned_steps(examples=10, batch_size=3, accumulation=1, ranks=1, epochs=3, max_steps=5) == 5


@pytest.mark.parametrize(
    ("lora", "checkpointing", "rows", "words", "max_length"),
    [
        (True, False, 4, 200, 256),
        (False, False, 4, 200, 256),
        (True, True, 4, 60, 128),
        (False, True, 4, 300, 256),
        # long rows of unequal lengths: attention's [rows, 1, width, width] mask is a third of the peak
        (True, False, 3, 800, 2048),
    ],
)
def test_estimate_within_tolerance_of_measured_peak(
    tiny_model_path: Path, lora: bool, checkpointing: bool, rows: int, words: int, max_length: int
) -> None:
    measured = measure_sft_peak(
        tiny_model_path,
        synthetic_rows(rows, words),
        use_lora=lora,
        max_length=max_length,
        gradient_checkpointing=checkpointing,
        mixed_precision="no",
    )
    estimate = estimate_memory(
        _shape(tiny_model_path),
        TrainingShape(
            lora=lora,
            micro_batch_rows=rows,
            row_width=measured.tokens // rows,
            micro_batch_targets=measured.targets,
            padded=measured.padded,
            gradient_checkpointing=checkpointing,
        ),
    )
    ratio = estimate.total / measured.peak_bytes
    assert 1 - TOLERANCE <= ratio <= 1 + TOLERANCE, (ratio, estimate.as_dict(), measured)


@pytest.mark.parametrize("family", ["gemma3", "idefics3", "qwen2_5_vl"])
def test_a_vision_bases_persistent_parts_are_the_trainers_tensors(
    family: str, vision_models: dict[str, Path]
) -> None:
    """A vision base (docs/vision.md): the language model's parts exactly as for a text model, the tower's
    and the projector's weights within 2% (their embeddings and norms are counted roughly), and what trains
    of them, with and without ``train_vision_tower`` / ``train_projector``, within 2% as well."""
    path = vision_models[family]
    shape = _shape(path)
    assert shape.vision is not None
    for lora, tower, projector in (
        (True, False, False),
        (False, False, False),
        (True, True, True),
        (False, True, True),
    ):
        config = SFTConfig(
            str(path),
            "/nonexistent",
            use_lora=lora,
            lora_r=4,
            train_vision_tower=tower,
            train_projector=projector,
        )
        model = load_model_to_train(config, torch.device("cpu"))
        job = TrainingShape(lora=lora, lora_r=4, train_vision_tower=tower, train_projector=projector)
        estimate = estimate_memory(shape, job)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert estimate.weights == pytest.approx(sum(p.nbytes for p in model.parameters()), rel=0.02)
        assert estimate.gradients == pytest.approx(4 * trainable, rel=0.02), (lora, tower, projector)
    # the tower's activations count only where it trains, and grow with the images' tokens
    frozen = estimate_memory(shape, TrainingShape(lora=True, image_tokens=64))
    trained = estimate_memory(shape, TrainingShape(lora=True, image_tokens=64, train_vision_tower=True))
    more = estimate_memory(shape, TrainingShape(lora=True, image_tokens=128, train_vision_tower=True))
    assert frozen.activations == estimate_memory(shape, TrainingShape(lora=True)).activations
    assert frozen.activations < trained.activations < more.activations


def test_the_image_tokens_and_patches_a_qwen2_5_vl_estimate_counts_are_its_processors(
    vision_models: dict[str, Path],
) -> None:
    """The estimate's image tokens (``sft_file_stats``, the tokens at the config's ``image_token_id``) are
    those Qwen2.5-VL's processor makes of each image (its grid's patches over 2x2 merged), and the
    patches the tower's activations are sized by (tokens x ``patches_per_image_token``) the rows of the
    pixels it encodes."""
    from tests.vision_families import data_url, image_bytes, image_row
    from trainers.data.file_stats import sft_file_stats
    from trainers.data.sft import tokenize_sft_rows
    from trainers.data.vision import ImageFiles, VisionData
    from trainers.modalities import image_token_id, patches_per_image_token
    from trainers.modeling.vision import load_processor, model_config

    path = str(vision_models["qwen2_5_vl"])
    config = model_config(path)
    vision = VisionData(load_processor(path), ImageFiles(), image_token_id=image_token_id(config))
    rows = [image_row(data_url(image_bytes(size))) for size in ((40, 30), (20, 50), (28, 28), (9, 9))]
    stats = sft_file_stats(rows, vision.tokenizer, max_length=4096, batch_size=4, vision=vision)
    examples = list(tokenize_sft_rows(rows, vision.tokenizer, max_length=4096, vision=vision))
    pixels = vision.batch_inputs(examples, max(len(e.input_ids) for e in examples))
    grids = pixels["image_grid_thw"]
    assert stats.image_tokens_per_epoch == int(grids.prod(dim=1).sum()) // 4 > len(rows)
    assert stats.image_tokens_per_epoch * patches_per_image_token(config) == pixels["pixel_values"].shape[0]
