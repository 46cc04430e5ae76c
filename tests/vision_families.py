"""Tiny vision-language models of the families the trainers take images for, built offline: a random-init
model from transformers' config classes, a byte-level BPE tokenizer with the family's special tokens,
the family's PIL image processor, and the processor with TRL's copy of the family's real chat template
(``trl/chat_templates``). Each is a folder that ``AutoProcessor`` and ``AutoModelForImageTextToText`` load.

Families here: Gemma 3, Idefics3 (SmolVLM's architecture) and Qwen2.5-VL. Qwen2.5-VL's processor takes a
video processor, which transformers 5.23 builds only with torchvision, and PyPI has no torchvision for a
CPU build of torch: it is built and loaded images-only (``trainers.modeling.vision.load_processor``),
saved as the ``Qwen2_5_VLProcessor`` a real checkpoint declares. Qwen3-VL's and SmolVLM's own processors
take a video processor too and are not built here (docs/vision.md).

    python -c "from tests.vision_families import build; print(build('gemma3', '/tmp/tiny-gemma3'))"
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import trl
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.trainers import BpeTrainer
from transformers import PreTrainedTokenizerFast

from trainers.modalities import VISION_FAMILIES
from trainers.modeling.tiny_model import CORPUS_PATH

TEMPLATES = Path(trl.__file__).parent / "chat_templates"
FAMILIES = ("gemma3", "idefics3", "qwen2_5_vl")

# the models' sizes: "tiny" for the tests; "bench" (bench/vision.py) wider, deeper and at a real image
# resolution (224 pixels in patches of 14)
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16},
        "vision": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
        },
        "image_size": 28,
        "patch_size": 7,
    },
    "bench": {
        "text": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "head_dim": 64},
        "vision": {
            "hidden_size": 192,
            "intermediate_size": 768,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
        },
        "image_size": 224,
        "patch_size": 14,
    },
}


def _text(size: str) -> dict[str, Any]:
    dims = dict(SIZES[size]["text"])
    head_dim = dims.pop("head_dim")
    return {**dims, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096} | (
        {"head_dim": head_dim} if head_dim * 4 != dims["hidden_size"] else {}
    )


def _vision(size: str) -> dict[str, Any]:
    return {
        **SIZES[size]["vision"],
        "image_size": SIZES[size]["image_size"],
        "patch_size": SIZES[size]["patch_size"],
    }


def _tokenizer(special: list[str], **kwargs: Any) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=400,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS_PATH.read_text(encoding="utf-8").splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=2048, **kwargs)  # type: ignore[no-untyped-call]


def _template(family: str) -> str:
    return (TEMPLATES / VISION_FAMILIES[family].template).read_text(encoding="utf-8")


def _gemma3(out: Path, size: str) -> None:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    special = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    image = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    tok = _tokenizer(
        special + image,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        extra_special_tokens={"boi_token": image[0], "eoi_token": image[1], "image_token": image[2]},
    )
    # tiny: 28x28 pixels in patches of 7, 16 patches pooled to 4 tokens an image (mm_tokens_per_image);
    # bench: 224 in patches of 14, 256 patches pooled to 64 tokens
    side = SIZES[size]["image_size"]
    tokens = (side // SIZES[size]["patch_size"]) ** 2 // 4
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": side, "width": side}),
        tokenizer=tok,
        chat_template=_template("gemma3"),
        image_seq_length=tokens,
    )
    text = _text(size)
    config = Gemma3Config(
        text_config={
            **text,
            "vocab_size": len(tok),
            "head_dim": text.get("head_dim", 16),
            "sliding_window": 64,
        },
        vision_config={**_vision(size), "vision_use_head": False},
        mm_tokens_per_image=tokens,
        boi_token_index=tok.convert_tokens_to_ids(image[0]),
        eoi_token_index=tok.convert_tokens_to_ids(image[1]),
        image_token_index=tok.convert_tokens_to_ids(image[2]),
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    # Gemma 3 starts its projection at zeros (its image features then vanish): random, so images count
    _save(out, Gemma3ForConditionalGeneration, config, processor, randomize=("mm_input_projection_weight",))


def _idefics3(out: Path, size: str) -> None:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tiles = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    special = ["<|endoftext|>", "<|begin_of_text|>", "<end_of_utterance>"]
    image = ["<fake_token_around_image>", "<image>", "<global-img>"]
    tok = _tokenizer(
        special + image + tiles,
        bos_token="<|begin_of_text|>",
        eos_token="<end_of_utterance>",
        pad_token="<|endoftext|>",
    )
    # tiny: images resized to a longest edge of 56 and split into 28x28 tiles plus the whole image at
    # 28x28, each tile 16 patches of 7, 4 tokens after the connector's pixel shuffle (scale_factor 2);
    # bench: tiles of 224, 256 patches of 14, 64 tokens each
    side = SIZES[size]["image_size"]
    tokens = (side // SIZES[size]["patch_size"]) ** 2 // 4
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            size={"longest_edge": 2 * side}, max_image_size={"longest_edge": side}, do_image_splitting=True
        ),
        tokenizer=tok,
        chat_template=_template("idefics3"),
        image_seq_len=tokens,
    )
    text = {**_text(size), "model_type": "llama", "vocab_size": len(tok), "pad_token_id": tok.pad_token_id}
    config = Idefics3Config(
        text_config=text,
        vision_config=_vision(size),
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    _save(out, Idefics3ForConditionalGeneration, config, processor)


def _save(
    out: Path,
    model_class: Callable[..., Any],
    config: Any,
    processor: Any,
    *,
    randomize: tuple[str, ...] = (),
) -> None:
    from transformers import GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_class(config)
        for name, param in model.named_parameters():
            if randomize and name.endswith(randomize):
                torch.nn.init.normal_(param, std=param.shape[0] ** -0.5)
    tok = processor.tokenizer
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(out)
    processor.save_pretrained(out)


def _qwen2_5_vl(out: Path, size: str) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from trainers.modeling.vision import Qwen2_5_VLImagesOnlyProcessor

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    image = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = _tokenizer(special + image, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    # tiny: an image resized to multiples of 14 pixels (patches of 7, merged 2x2 into a token) within
    # 196..784 pixels, so 1 to 4 tokens; bench: patches of 14 within 224x224 pixels, up to 64 tokens.
    # Qwen's own processor would take a video processor too, which needs torchvision: images only here
    # (trainers.modeling.vision.load_processor), saved as a Qwen2_5_VLProcessor as a real checkpoint is
    side, patch = SIZES[size]["image_size"], SIZES[size]["patch_size"]
    pixels = {"shortest_edge": (2 * patch) ** 2, "longest_edge": side * side}
    processor = Qwen2_5_VLImagesOnlyProcessor(
        image_processor=Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, size=pixels),
        tokenizer=tok,
        chat_template=_template("qwen2_5_vl"),
    )
    # what a Qwen2VLVideoProcessor would save beside it (written back by a job's checkpoints)
    processor.video_processor_config = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": pixels,
    }
    text = _text(size)
    head_dim = text.get("head_dim", text["hidden_size"] // text["num_attention_heads"])
    half = head_dim // 2  # M-RoPE splits each head's rotary halves into time, height and width sections
    sections = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]
    vision = SIZES[size]["vision"]
    ids = {t: tok.convert_tokens_to_ids(t) for t in image}
    config = Qwen2_5_VLConfig(
        text_config={
            **text,
            "vocab_size": len(tok),
            "bos_token_id": tok.pad_token_id,  # Qwen's <|endoftext|>; its chat rows start with none
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections},
        },
        vision_config={
            "depth": vision["num_hidden_layers"],
            "hidden_size": vision["hidden_size"],
            "intermediate_size": vision["intermediate_size"],
            "num_heads": vision["num_attention_heads"],
            "patch_size": patch,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": text["hidden_size"],
            # windows of 2x2 merged tokens in the first layers, full attention in the last (as the real
            # model alternates them)
            "window_size": 4 * patch,
            "fullatt_block_indexes": [vision["num_hidden_layers"] - 1],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    _save(out, Qwen2_5_VLForConditionalGeneration, config, processor)


_BUILDERS = {"gemma3": _gemma3, "idefics3": _idefics3, "qwen2_5_vl": _qwen2_5_vl}


def build(family: str, out_dir: str | Path, *, size: str = "tiny") -> Path:
    """Write the ``family`` model of ``size`` (``SIZES``) and its processor to ``out_dir`` (once); return
    the folder."""
    out = Path(out_dir)
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        _BUILDERS[family](out, size)
    return out


# -- images and rows ------------------------------------------------------------------------------------


def image_bytes(
    size: tuple[int, int] = (40, 30), color: tuple[int, int, int] = (200, 30, 30), fmt: str = "PNG"
) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format=fmt)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(url: str, detail: str = "auto") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}}


def image_row(url: str, answer: str = "A red square.", question: str = "What is this?") -> dict[str, Any]:
    """An SFT row asking about one image (OpenAI's vision fine-tuning shape)."""
    return {
        "messages": [
            {"role": "system", "content": "You describe images."},
            {"role": "user", "content": [{"type": "text", "text": question}, image_part(url)]},
            {"role": "assistant", "content": answer},
        ]
    }


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()
