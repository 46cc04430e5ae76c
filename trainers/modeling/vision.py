"""Load a vision-language base to train, and its processor.

A model whose config takes images (``trainers.modalities``) loads as transformers'
``AutoModelForImageTextToText`` (each family's ``...ForConditionalGeneration``) beside its processor
(``AutoProcessor``: the image processor and the tokenizer, and the chat template the family's rows
render with). What trains, by default, is the language model: LoRA adapts its linear layers (or, without
``lora``, every weight of it trains), and the vision tower and the projector stay frozen.
``train_vision_tower`` adds the tower's linear layers to the adapter (every weight of it without LoRA);
``train_projector`` trains the projector in full (peft's ``modules_to_save`` under LoRA). The LM head is
the language model's: frozen under LoRA, trained in full fine-tuning, as for a text model.

Weights and precision as ``trainers.modeling.loading``: a LoRA base in bf16 where the run computes in
bf16, the adapter and a fully trained model in fp32; a resumed run's trainable weights from the
checkpoint's ``model/`` folder. A quantized vision base is refused for now (``quantization``): its tower
and projector would need to stay out of the 4-bit layers, which is not tested here.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from PIL import Image
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoProcessor,
    PreTrainedModel,
    Qwen2_5_VLProcessor,
)
from transformers.processing_utils import ProcessorMixin

from trainers.chat.images import parse_data_url
from trainers.core.checkpoint import MODEL_DIR
from trainers.core.errors import DataError
from trainers.modalities import VISION_FAMILIES, part_of, takes_images
from trainers.modeling.loading import ModelSettings, lora_base_dtype, restore_adapter


def model_config(model_path: str) -> dict[str, Any]:
    """The model's ``config.json`` as a dict (a copy)."""
    return dict(_config(model_path))


@functools.lru_cache(maxsize=64)
def _config(model_path: str) -> dict[str, Any]:
    local = Path(model_path) / "config.json"
    if local.is_file():
        config: dict[str, Any] = json.loads(local.read_text(encoding="utf-8"))
        return config
    return dict(AutoConfig.from_pretrained(model_path).to_dict())


def is_vision_model(model_path: str) -> bool:
    """Whether the model at ``model_path`` takes images (``trainers.modalities.takes_images``)."""
    return takes_images(_config(model_path))


class Qwen2_5_VLImagesOnlyProcessor(Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor without its video processor: the same image processor, tokenizer, chat
    template and call for rows with images (what it answers for images never reads the video processor),
    but buildable where transformers' video processors are not (they need torchvision, which a CPU build
    of torch has no PyPI wheel for). It saves as ``Qwen2_5_VLProcessor`` and writes back the video
    processor's config the checkpoint had (``video_processor_config``, kept as data), so a saved folder
    loads with ``AutoProcessor`` wherever the base did."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None) -> None:
        # Qwen2_5_VLProcessor.__init__ less the video processor (the attributes are __init__'s arguments)
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        self.video_processor_config: dict[str, Any] | None = None
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)  # type: ignore[no-untyped-call]

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["processor_class"] = Qwen2_5_VLProcessor.__name__
        if self.video_processor_config is not None:
            out["video_processor"] = self.video_processor_config
        return out


# the processor class a checkpoint declares -> the images-only one to load it as
_IMAGES_ONLY: dict[str, type[ProcessorMixin]] = {"Qwen2_5_VLProcessor": Qwen2_5_VLImagesOnlyProcessor}


def _declared_processor(model_path: str) -> str | None:
    """The processor class a local checkpoint (a base, or a job's adapter folder, which has no
    ``config.json``) declares: ``processor_class`` of its ``processor_config.json`` as transformers 5
    saves it, or of the older ``preprocessor_config.json`` a hub checkpoint has."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        file = Path(model_path) / name
        if file.is_file():
            declared = json.loads(file.read_text(encoding="utf-8")).get("processor_class")
            if isinstance(declared, str):
                return declared
    return None


def _video_processor_config(model_path: str) -> dict[str, Any] | None:
    """The config a local checkpoint's video processor loads from, as JSON, found where transformers 5.23
    looks for it (``video_processing_utils.get_video_processor_dict``): nested in ``processor_config.json``,
    else ``video_preprocessor_config.json``, else the older hub checkpoints' ``preprocessor_config.json``."""
    folder = Path(model_path)
    nested = folder / "processor_config.json"
    if nested.is_file():
        found = json.loads(nested.read_text(encoding="utf-8")).get("video_processor")
        if isinstance(found, dict):
            return found
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (folder / name).is_file():
            return dict(json.loads((folder / name).read_text(encoding="utf-8")))
    return None


def load_processor(model_path: str) -> ProcessorMixin:
    """The model's processor: its image processor, its tokenizer (a pad token set as
    ``modeling.loading.load_tokenizer`` sets it) and its chat template, which the tokenizer renders
    the rows with from then on (a processor may keep a template of its own beside the tokenizer's).

    A checkpoint declaring Qwen2.5-VL's processor loads images-only (``Qwen2_5_VLImagesOnlyProcessor``),
    always, not as a fallback when ``AutoProcessor`` fails: the full processor needs torchvision for its
    video processor (an ``ImportError`` where torchvision is missing, an ``OSError`` where the folder has
    no video config), catching those would hide other faults, and a job's tokens must not depend on
    whether a worker happens to have torchvision. Rows carry no video, so nothing is lost."""
    images_only = _IMAGES_ONLY.get(_declared_processor(model_path) or "")
    processor: ProcessorMixin
    if images_only is not None:
        processor = images_only.from_pretrained(model_path)
        processor.video_processor_config = _video_processor_config(model_path)  # type: ignore[attr-defined]
    else:
        processor = AutoProcessor.from_pretrained(model_path)  # type: ignore[no-untyped-call]
    tokenizer = processor.tokenizer
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is always masked out
    if getattr(processor, "chat_template", None):
        tokenizer.chat_template = processor.chat_template
    return processor


def _part(model: PreTrainedModel) -> Callable[[str], str]:
    """name -> ``language_model``, ``vision_tower`` or ``projector`` for ``model``'s modules."""
    family = VISION_FAMILIES.get(str(model.config.model_type))
    if family is not None:
        return functools.partial(part_of, family)
    decoder = model.get_decoder()  # type: ignore[no-untyped-call]
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    return lambda name: (
        "language_model" if name.startswith(prefix) or name.startswith("lm_head") else "vision_tower"
    )


def _asked(settings: ModelSettings, knob: str) -> bool:
    """A ``VISION`` knob of the settings (a method without them trains the language model alone)."""
    return bool(getattr(settings, knob, False))


def _refuse_unknown(model: PreTrainedModel, settings: ModelSettings) -> None:
    if str(model.config.model_type) in VISION_FAMILIES:
        return
    for knob in ("train_vision_tower", "train_projector"):
        if _asked(settings, knob):
            raise DataError(
                f"{knob}: the parts of a '{model.config.model_type}' model are not declared "
                "(trainers/modalities.py); its language model alone trains",
                param=f"hyperparameters.{knob}",
            )


def lora_targets(model: PreTrainedModel, settings: ModelSettings) -> list[str]:
    """The linear layers LoRA adapts: the language model's (and the vision tower's with
    ``train_vision_tower``), all of them or those whose names end with one of ``lora_target_modules``;
    never the LM head."""
    part = _part(model)
    trained = {"language_model"} | ({"vision_tower"} if _asked(settings, "train_vision_tower") else set())
    wanted = settings.lora_target_modules
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and part(name) in trained
        and module is not model.get_output_embeddings()  # type: ignore[no-untyped-call]
        and (wanted is None or any(name == w or name.endswith("." + w) for w in wanted))
    ]
    if not names:
        raise DataError(
            f"lora_target_modules={wanted!r} names no linear layer of the model's language model",
            param="hyperparameters.lora_target_modules",
        )
    return names


def projector_modules(model: PreTrainedModel) -> list[str]:
    """The projector's top modules (peft's ``modules_to_save`` when it trains under LoRA)."""
    family = VISION_FAMILIES.get(str(model.config.model_type))
    return list(family.projector) if family is not None else []


def load_vision_model(
    settings: ModelSettings, device: torch.device, *, adapter_name: str = "default"
) -> torch.nn.Module:
    """The vision-language model to train (module docstring), on ``device``."""
    if settings.quantization is not None:
        raise DataError(
            "quantization is not supported for vision bases yet", param="hyperparameters.quantization"
        )
    resume_model = Path(settings.resume_from) / MODEL_DIR if settings.resume_from else None
    model: torch.nn.Module
    if settings.use_lora:
        base = AutoModelForImageTextToText.from_pretrained(
            settings.model_path, dtype=lora_base_dtype(settings, device)
        )
        _refuse_unknown(base, settings)
        config = LoraConfig(
            task_type=TaskType.CAUSAL_LM,
            r=settings.lora_r,
            lora_alpha=settings.lora_alpha,
            lora_dropout=settings.lora_dropout,
            target_modules=lora_targets(base, settings),
            modules_to_save=projector_modules(base) if _asked(settings, "train_projector") else None,
        )
        with warnings.catch_warnings():
            # peft 0.21 reads `model.is_gradient_checkpointing`, which transformers 5 deprecates
            warnings.filterwarnings(
                "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
            model = get_peft_model(base, config, adapter_name=adapter_name)
        assert isinstance(model, PeftModel)
        if _asked(settings, "train_projector"):  # the trained copy in fp32, as an adapter is
            for name in projector_modules(base):
                model.get_submodule(f"base_model.model.{name}").float()
        if resume_model is not None:
            restore_adapter(model, resume_model, adapter_name)
    else:
        source = str(resume_model) if resume_model is not None else settings.model_path
        model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32)
        _refuse_unknown(model, settings)
        part = _part(model)
        trained = (
            {"language_model"}
            | ({"vision_tower"} if _asked(settings, "train_vision_tower") else set())
            | ({"projector"} if _asked(settings, "train_projector") else set())
        )
        for name, param in model.named_parameters():
            param.requires_grad_(part(name) in trained)
    # (transformers' typed `to` rejects a device)
    return torch.nn.Module.to(model, device)


# -- serving (worker/inference.py) ---------------------------------------------------------------------


def load_vision_for_serving(
    path: str | Path, adapter_dir: str | Path | None = None
) -> tuple[Any, ProcessorMixin]:
    """A vision-language model to generate with (eval mode; a LoRA checkpoint's adapter merged into its
    base) and its processor (the checkpoint's, which a job saves with it)."""
    model: Any = AutoModelForImageTextToText.from_pretrained(path)
    if adapter_dir is not None:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
            model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    model.eval()
    return model, load_processor(str(adapter_dir if adapter_dir is not None else path))


def vision_prompt(
    processor: ProcessorMixin, text: str, images: list[str], *, n: int
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """A chat's prompt (``text``, rendered by the model's template with a placeholder per image) for
    generating ``n`` replies from a vision model: its token ids, each image (a data URL, in order)
    expanded by the processor's own call, and the model's other inputs for the ``n`` rows (pixels,
    per-token types)."""
    pictures = [_decoded(url) for url in images]
    out = processor(text=[text] * n, images=[pictures] * n, return_tensors="pt", add_special_tokens=False)
    ids = [int(t) for t in out["input_ids"][0]]
    return ids, {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}


def _decoded(url: str) -> Image.Image:
    _, payload = parse_data_url(url)
    with Image.open(io.BytesIO(base64.b64decode(payload))) as image:
        image.load()
        return image
