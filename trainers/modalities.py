"""What a model can take (text, images), declared once, from its ``config.json``; and the vision-language
families: where each keeps its vision tower, its projector and its language model.

A model takes images when its config is one of ``VISION_FAMILIES`` or has a ``vision_config`` (transformers'
image-text-to-text models). The job creation refuses a file with images for a model that takes none
(``service.jobs.creation``), the catalogue lists each model's ``modalities`` and the trainers load a
vision model through its processor (``trainers.modeling.vision``). Standard library only: the service
reads it.

A family's module prefixes (names under the transformers model, as ``named_modules`` gives them) say
what trains: LoRA adapts the language model's linear layers by default, and the vision tower and the
projector stay frozen unless a job asks (``train_vision_tower``, ``train_projector``: docs/vision.md).
A family not listed here but with a ``vision_config`` trains its language model, found through the
model's ``get_decoder()``, and refuses those two knobs.

>>> modalities({"model_type": "llama"}), modalities({"model_type": "gemma3", "vision_config": {}})
(('text',), ('text', 'image'))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TEXT, IMAGE = "text", "image"


@dataclass(frozen=True)
class VisionFamily:
    """A vision-language family: its transformers ``model_type``, its name in docs, TRL's chat template
    of it (``trl/chat_templates``) and the prefixes of its parts' modules."""

    model_type: str
    name: str
    template: str
    vision_tower: tuple[str, ...]
    projector: tuple[str, ...]  # checked before the vision tower: it may sit inside it (Qwen's merger)


VISION_FAMILIES: dict[str, VisionFamily] = {
    f.model_type: f
    for f in (
        VisionFamily(
            "gemma3", "Gemma 3", "gemma3.jinja", ("model.vision_tower",), ("model.multi_modal_projector",)
        ),
        VisionFamily("idefics3", "Idefics3", "idefics3.jinja", ("model.vision_model",), ("model.connector",)),
        VisionFamily("smolvlm", "SmolVLM", "smolvlm.jinja", ("model.vision_model",), ("model.connector",)),
        VisionFamily(
            "llava_next",
            "LLaVA-NeXT",
            "llava_next.jinja",
            ("model.vision_tower",),
            ("model.multi_modal_projector", "model.image_newline"),
        ),
        VisionFamily(
            "qwen2_5_vl", "Qwen2.5-VL", "qwen2_5_vl.jinja", ("model.visual",), ("model.visual.merger",)
        ),
        VisionFamily(
            "qwen3_vl",
            "Qwen3-VL",
            "qwen3_vl.jinja",
            ("model.visual",),
            ("model.visual.merger", "model.visual.deepstack_merger_list"),
        ),
    )
}


def takes_images(config: Mapping[str, Any]) -> bool:
    """Whether the model of ``config`` (a ``config.json`` dict) takes images."""
    return config.get("model_type") in VISION_FAMILIES or isinstance(config.get("vision_config"), Mapping)


def modalities(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The inputs the model of ``config`` takes: ``("text",)`` or ``("text", "image")``."""
    return (TEXT, IMAGE) if takes_images(config) else (TEXT,)


def part_of(family: VisionFamily, module_name: str) -> str:
    """Which part of a ``family`` model a module belongs to: ``projector``, ``vision_tower`` or
    ``language_model`` (everything else: the decoder, its embeddings and the LM head)."""
    for part, prefixes in (("projector", family.projector), ("vision_tower", family.vision_tower)):
        if any(module_name == p or module_name.startswith(p + ".") for p in prefixes):
            return part
    return "language_model"


def image_token_id(config: Mapping[str, Any]) -> int | None:
    """The token the model's language model takes an image's features at (what the processor expands
    each image into: Gemma 3's soft tokens, Idefics3's ``<image>``, Qwen's ``<|image_pad|>``)."""
    value = config.get("image_token_id", config.get("image_token_index"))
    return value if isinstance(value, int) else None


def patches_per_image_token(config: Mapping[str, Any]) -> float:
    """How many patches the vision tower encodes for one image token of the text: Gemma 3 pools its
    (image_size / patch_size)^2 patches into ``mm_tokens_per_image``, Idefics3 and SmolVLM shuffle
    ``scale_factor``^2 patches into a token, Qwen merges ``spatial_merge_size``^2; 1 otherwise."""
    vision = config.get("vision_config") or {}
    model_type = config.get("model_type")
    if model_type == "gemma3" and config.get("mm_tokens_per_image"):
        patches = (int(vision.get("image_size", 896)) // int(vision.get("patch_size", 14))) ** 2
        return patches / int(config["mm_tokens_per_image"])
    if model_type in ("idefics3", "smolvlm"):
        return float(config.get("scale_factor", 1)) ** 2
    if model_type in ("qwen2_5_vl", "qwen3_vl"):
        return float(vision.get("spatial_merge_size", 2)) ** 2
    return 1.0
