"""Vision-language bases, on tiny random models of each family built offline with their real chat templates
(tests/vision_families.py): rows with images tokenize as the processor's own call makes them, with loss on
the assistant's tokens only and never on an image's; a batch's loss is a plain transformers forward's on
the same rows; a job trains the language model (LoRA, or in full) with the tower and projector frozen unless
asked; its checkpoint and export load with the family's class and generate from an image; DPO takes
images in its prompts; packing and text-only models refuse images, naming what.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from tests.trainers.helpers import Recorder
from tests.vision_families import FAMILIES, data_url, image_bytes, image_part, image_row
from trainers.core.errors import DataError
from trainers.data.collate import pad_batch_with_inputs
from trainers.data.packing import PairPacking
from trainers.data.sft import tokenize_sft_rows
from trainers.data.vision import ImageFiles, VisionData, VisionExample
from trainers.families.entry import load_model_to_train
from trainers.losses.causal_lm import IGNORE_INDEX
from trainers.methods.dpo import DPOConfig, train_dpo
from trainers.methods.sft import SFTConfig, sft_loss, train_sft
from trainers.modalities import VISION_FAMILIES, part_of
from trainers.modeling.loading import pair_packing, runs_packed
from trainers.modeling.vision import (
    Qwen2_5_VLImagesOnlyProcessor,
    load_processor,
    load_vision_for_serving,
)

RED, BLUE = (220, 20, 20), (20, 20, 220)


def _rows() -> list[dict[str, Any]]:
    """Two rows of different lengths: one image; two images in two user turns, two answers."""
    two_turns = {
        "messages": [
            {
                "role": "user",
                "content": [
                    image_part(data_url(image_bytes((40, 30), RED))),
                    {"type": "text", "text": "Colour?"},
                ],
            },
            {"role": "assistant", "content": "Red."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "And this one?"},
                    image_part(data_url(image_bytes((20, 50), BLUE, "JPEG"), "image/jpeg")),
                ],
            },
            {"role": "assistant", "content": "Blue, and taller."},
        ]
    }
    return [image_row(data_url(image_bytes((30, 30), RED)), "A red square."), two_turns]


def _hf_messages(row: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    """The row as transformers' processors take it (``{"type": "image"}`` parts), and its images: built
    here, apart from ``trainers.chat.rows``."""
    import base64
    import io

    from PIL import Image

    messages, images = [], []
    for m in row["messages"]:
        content = m["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts = []
        for part in content:
            if part["type"] == "image_url":
                payload = part["image_url"]["url"].split(",", 1)[1]
                images.append(Image.open(io.BytesIO(base64.b64decode(payload))))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        messages.append({"role": m["role"], "content": parts})
    return messages, images


def _reference_batch(processor: Any, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Each row rendered whole by the processor's template and run through its own call, batched; labels
    on the tokens each assistant turn adds after its generation prompt."""
    texts, images, spans = [], [], []
    for row in rows:
        messages, row_images = _hf_messages(row)
        texts.append(processor.apply_chat_template(messages, tokenize=False))
        images.append(row_images)
        turns = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                before = processor.apply_chat_template(
                    messages[:i], tokenize=False, add_generation_prompt=True
                )
                upto = processor.apply_chat_template(messages[: i + 1], tokenize=False)
                shown = [im for im in row_images][: before.count(processor.image_token)]
                turns.append((_length(processor, before, shown), _length(processor, upto, shown)))
        spans.append(turns)
    batch = dict(
        processor(text=texts, images=images, return_tensors="pt", padding=True, add_special_tokens=False)
    )
    labels = torch.full_like(batch["input_ids"], IGNORE_INDEX)
    for row, turns in enumerate(spans):
        for start, end in turns:
            labels[row, start:end] = batch["input_ids"][row, start:end]
    batch["labels"] = labels
    return batch


def _plain_processor(path: Path) -> Any:
    """transformers' own processor of the model: ``AutoProcessor``'s where it builds (with torchvision,
    Qwen2.5-VL's full one, so the images-only one is checked against it), else Qwen2.5-VL's images-only one
    (its video processor needs torchvision; what it answers for images is the full one's call)."""
    try:
        return AutoProcessor.from_pretrained(path)
    except ImportError:
        return Qwen2_5_VLImagesOnlyProcessor.from_pretrained(path)


def _length(processor: Any, text: str, images: list[Any]) -> int:
    if not images:
        return len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    return len(processor(text=[text], images=[images], add_special_tokens=False)["input_ids"][0])


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, vision_models: dict[str, Path]) -> tuple[str, Path]:
    return request.param, vision_models[request.param]


def _config(path: Path, out: Path, **overrides: Any) -> SFTConfig:
    fields: dict[str, Any] = {"model_path": str(path), "output_dir": str(out), "batch_size": 2, "seed": 0}
    return SFTConfig(**(fields | overrides))


def test_rows_tokenize_as_the_processor_makes_them_and_the_loss_is_a_plain_forwards(
    family: tuple[str, Path], tmp_path: Path
) -> None:
    _, path = family
    rows = _rows()
    processor = load_processor(str(path))
    vision = VisionData(processor, ImageFiles())
    examples = list(tokenize_sft_rows(rows, processor.tokenizer, max_length=4096, vision=vision))
    assert all(isinstance(e, VisionExample) for e in examples) and len(examples) == 2

    reference = _reference_batch(_plain_processor(path), rows)
    image_id = AutoModelForImageTextToText.from_pretrained(path).config.image_token_id
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        assert e.input_ids == reference["input_ids"][row, :n].tolist()
        trained = [t != IGNORE_INDEX for t in reference["labels"][row, :n].tolist()]
        assert e.loss_mask[1:] == trained[1:]
        images = [i for i, t in enumerate(e.input_ids) if t == image_id]
        assert images and not any(e.loss_mask[i] for i in images)  # image tokens never train

    # the training path's loss (the model as a job loads it, kernels installed) is transformers' own
    model = load_model_to_train(_config(path, tmp_path, use_lora=False), torch.device("cpu"))
    batch = pad_batch_with_inputs(examples, pad_token_id=processor.tokenizer.pad_token_id, inputs=vision)
    # every input the processor gives the model, ours too: pixels, and the family's others (Qwen's
    # image_grid_thw and the mm_token_type_ids its M-RoPE positions are computed from)
    given = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, **batch.extra_inputs}
    assert set(given) == set(reference) - {"labels"}
    for key, value in given.items():
        assert torch.equal(value, reference[key].to(value.dtype)), key
    plain = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ours = sft_loss(model, batch).loss / batch.n_targets
        theirs = plain(**reference).loss
    # rtol=0: dropping Qwen's M-RoPE token types moves this tiny batch's loss by 6e-5, within 1e-5 relative
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-5), (ours, theirs)


def _files(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of a folder's safetensors files, by their names there (an adapter's)."""
    return {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    """A model folder's weights under the loaded model's names (transformers saves some families under
    other names: Gemma 3's ``multi_modal_projector...`` is the model's ``model.multi_modal_projector...``)."""
    return dict(AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).state_dict())


def test_a_lora_job_trains_the_language_model_and_its_export_loads_and_reads_images(
    family: tuple[str, Path], tmp_path: Path
) -> None:
    name, path = family
    rows = _rows() * 2
    config = _config(path, tmp_path, n_epochs=2, max_steps=4, learning_rate=5e-3, save_steps=2)
    result = train_sft(config, rows)
    assert result.final_checkpoint is not None and result.steps == 4

    # the adapter of step 2 adapts the language model's layers only
    adapter = _files(tmp_path / "checkpoint-000002" / "model")
    parts = {part_of(VISION_FAMILIES[name], k.removeprefix("base_model.model.")) for k in adapter}
    assert parts == {"language_model"} and all("lora_" in k for k in adapter)

    export = result.final_checkpoint.path / "model"
    model_class = type(AutoModelForImageTextToText.from_pretrained(path))
    trained = model_class.from_pretrained(export)  # the family's own class
    assert type(trained).__name__.endswith("ForConditionalGeneration")
    base, after = _weights(path), _weights(export)
    family_ = VISION_FAMILIES[name]
    moved = {part_of(family_, k) for k in base if not torch.equal(base[k], after[k])}
    assert moved == {"language_model"}

    # the adapter checkpoint serves too: on its base, merged (worker/inference.py's path)
    adapted, adapter_processor = load_vision_for_serving(path, tmp_path / "checkpoint-000002" / "model")
    assert type(adapted) is model_class and adapter_processor.chat_template

    processor = _plain_processor(export)
    messages, images = _hf_messages(rows[0])
    prompt = processor.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[images], return_tensors="pt", add_special_tokens=False)
    out = trained.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


def test_full_fine_tuning_freezes_the_tower_and_trains_the_projector_when_asked(
    family: tuple[str, Path], tmp_path: Path
) -> None:
    name, path = family
    config = _config(path, tmp_path, use_lora=False, train_projector=True, max_steps=2, learning_rate=1e-3)
    result = train_sft(config, _rows())
    assert result.final_checkpoint is not None
    base, after = _weights(path), _weights(result.final_checkpoint.path / "model")
    moved = {part_of(VISION_FAMILIES[name], k) for k in base if not torch.equal(base[k], after[k])}
    assert moved == {"language_model", "projector"}


def test_dpo_trains_on_pairs_whose_prompt_has_images(family: tuple[str, Path], tmp_path: Path) -> None:
    def pair(color: tuple[int, int, int], good: str, bad: str) -> dict[str, Any]:
        question = [image_part(data_url(image_bytes((30, 30), color))), {"type": "text", "text": "Colour?"}]
        return {
            "input": {"messages": [{"role": "user", "content": question}]},
            "preferred_output": [{"role": "assistant", "content": good}],
            "non_preferred_output": [{"role": "assistant", "content": bad}],
        }

    rows = [pair(RED, "Red.", "Blue."), pair(BLUE, "Blue.", "Red.")]
    config = DPOConfig(
        model_path=str(family[1]),
        output_dir=str(tmp_path),
        batch_size=2,
        max_steps=3,
        n_epochs=3,
        learning_rate=5e-3,
    )
    result = train_dpo(config, rows)
    assert result.steps == 3 and result.metrics["rewards/margins"] > 0


def test_packing_and_text_models_refuse_images_naming_what(
    vision_models: dict[str, Path], tiny_model_path: Path, tmp_path: Path
) -> None:
    for family in FAMILIES:
        path = vision_models[family]
        with pytest.raises(DataError, match="packing is not supported on a vision base") as refused:
            train_sft(_config(path, tmp_path, packing=True, max_steps=1), _rows())
        assert refused.value.param == "hyperparameters.packing"
        # nor does anything pack implicitly: packed rows' position ids would replace the positions the
        # model computes per row from its images (Qwen's M-RoPE from image_grid_thw)
        model = load_model_to_train(_config(path, tmp_path), torch.device("cpu"))
        assert not runs_packed(model) and pair_packing(model) is PairPacking.PADDED, family
    with pytest.raises(
        DataError, match=r"line 1: field 'messages\[1\].content\[1\]': the model takes text only"
    ):
        train_sft(_config(tiny_model_path, tmp_path, max_steps=1), _rows())


def test_truncation_never_splits_an_image_and_leaves_later_ones_out(vision_models: dict[str, Path]) -> None:
    processor = load_processor(str(vision_models["idefics3"]))
    vision = VisionData(processor, ImageFiles())
    rows = _rows()[1:]
    (full,) = tokenize_sft_rows(rows, processor.tokenizer, max_length=4096, vision=vision)
    assert isinstance(full, VisionExample)
    first, second = full.vision["segments"]
    inside = (second[0] + second[1]) // 2  # a cut inside the second image's segment
    cut = full.truncated(inside)
    assert len(cut.input_ids) == second[0] and cut.vision["images"] == full.vision["images"][:1]
    assert cut.n_trainable > 0  # the first answer still trains
    with pytest.raises(DataError, match="every example was truncated away"):
        tokenize_sft_rows(rows, processor.tokenizer, max_length=(first[0] + first[1]) // 2, vision=vision)


def test_a_vision_run_resumed_repeats_the_uninterrupted_run(
    vision_models: dict[str, Path], tmp_path: Path
) -> None:
    """Its images come back from the rows on resume: the steps after the checkpoint are the same."""
    path = vision_models["gemma3"]
    rows = _rows() * 2
    full = Recorder()
    run = {"n_epochs": 2, "max_steps": 4, "learning_rate": 5e-3, "save_steps": 2}
    train_sft(_config(path, tmp_path / "a", **run), rows, callbacks=full)
    resumed = Recorder()
    mid = str(tmp_path / "a" / "checkpoint-000002")
    train_sft(_config(path, tmp_path / "b", **run, resume_from=mid), rows, callbacks=resumed)
    assert [int(r["step"]) for r in resumed.steps] == [3, 4]
    for ours, theirs in zip(resumed.steps, full.steps[2:], strict=True):
        for key in ("loss", "grad_norm", "trained_tokens", "mean_token_accuracy"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-6), key


def test_a_qwen2_5_vl_checkpoint_as_the_hub_has_it_loads_its_processor_without_torchvision(
    vision_models: dict[str, Path], tmp_path: Path
) -> None:
    """A real Qwen2.5-VL checkpoint's processor files (``preprocessor_config.json`` declaring
    ``Qwen2_5_VLProcessor``, ``video_preprocessor_config.json``, ``chat_template.json``): the processor
    loads images-only, tokenizes as the tiny base's, and saves back as ``Qwen2_5_VLProcessor`` with the
    video processor's config, as a job's checkpoint does."""
    import importlib.util
    import json
    import shutil

    tiny = vision_models["qwen2_5_vl"]
    saved = json.loads((tiny / "processor_config.json").read_text())
    hub = tmp_path / "hub"
    hub.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny / name, hub / name)
    image = {**saved["image_processor"], "processor_class": "Qwen2_5_VLProcessor"}
    (hub / "preprocessor_config.json").write_text(json.dumps(image))
    (hub / "video_preprocessor_config.json").write_text(json.dumps(saved["video_processor"]))
    template = (tiny / "chat_template.jinja").read_text()
    (hub / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    if importlib.util.find_spec("torchvision") is None:
        with pytest.raises(ImportError, match="Torchvision"):
            AutoProcessor.from_pretrained(hub)

    processor = load_processor(str(hub))
    assert type(processor) is Qwen2_5_VLImagesOnlyProcessor and processor.chat_template == template
    rows = _rows()
    ours = tokenize_sft_rows(
        rows, processor.tokenizer, max_length=4096, vision=VisionData(processor, ImageFiles())
    )
    tiny_processor = load_processor(str(tiny))
    theirs = tokenize_sft_rows(
        rows, tiny_processor.tokenizer, max_length=4096, vision=VisionData(tiny_processor, ImageFiles())
    )
    assert [e.input_ids for e in ours] == [e.input_ids for e in theirs]

    processor.save_pretrained(tmp_path / "export")
    written = json.loads((tmp_path / "export" / "processor_config.json").read_text())
    assert written["processor_class"] == "Qwen2_5_VLProcessor"
    assert written["video_processor"] == saved["video_processor"]
