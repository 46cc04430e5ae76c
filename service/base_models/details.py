"""What a base model is, read from its Hugging Face folder without loading it (no torch): architecture,
parameter count (from the safetensors headers), context length, chat template and modalities (from
config.json and the tokenizer's files), and what this deployment can train on it (derived from the method
registry). `GET /v1/models` shows it; `tunehouse models add` stores it with the model.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from trainers.modalities import IMAGE, modalities
from trainers.registry import METHODS, get_method

# the safetensors format: an 8-byte little-endian header length, then the JSON header
_HEADER_LENGTH = struct.Struct("<Q")
MAX_HEADER_BYTES = 100 * 1024 * 1024


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def safetensors_parameters(path: Path) -> int:
    """The number of values in a .safetensors file's tensors, from its header alone."""
    with path.open("rb") as fh:
        (length,) = _HEADER_LENGTH.unpack(fh.read(_HEADER_LENGTH.size))
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path.name}: a safetensors header of {length} bytes")
        header = json.loads(fh.read(length))
    total = 0
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for dim in tensor["shape"]:
            count *= int(dim)
        total += count
    return total


def chat_template(folder: Path) -> str | None:
    """The template the tokenizer applies: `chat_template.jinja` (transformers 4.43+), else the
    tokenizer config's `chat_template` (a string, or the default of a list of named ones)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def trainable(architecture: str | None, *, images: bool = False) -> dict[str, Any]:
    """What jobs and Tinker clients can do with a base of this architecture: every method, LoRA and full,
    and a quantized base for LoRA, on a causal LM; on a vision-language model (``images``: it takes
    them, ``trainers.modalities``), the methods that train on images, LoRA and full, unquantized
    (docs/vision.md); nothing yet on other heads."""
    if images:
        return {
            "methods": [m.name for m in METHODS.values() if m.images],
            "lora": True,
            "full": True,
            "quantization": [],
        }
    if architecture is None or not architecture.endswith("ForCausalLM"):
        return {
            "methods": [],
            "lora": False,
            "full": False,
            "quantization": [],
            "reason": f"{architecture or 'an unknown architecture'} is not a causal LM; the trainers "
            "train causal LMs only",
        }
    quantization = get_method("supervised").hyperparameter("quantization").choices or ()
    return {"methods": list(METHODS), "lora": True, "full": True, "quantization": list(quantization)}


def model_details(folder: Path) -> dict[str, Any]:
    """The details of the model in `folder` (a Hugging Face model folder)."""
    config = _json(folder / "config.json")
    architectures = config.get("architectures") or []
    architecture = str(architectures[0]) if architectures else None
    text_config = config.get("text_config")
    text: dict[str, Any] = text_config if isinstance(text_config, dict) else config
    context = text.get("max_position_embeddings") or _json(folder / "tokenizer_config.json").get(
        "model_max_length"
    )
    takes = list(modalities(config))  # the trainers' own rule (trainers/modalities.py)
    weights = sorted(folder.rglob("*.safetensors"))
    return {
        "architecture": architecture,
        "model_type": config.get("model_type"),
        "parameters": sum(safetensors_parameters(p) for p in weights) if weights else None,
        "context_length": int(context) if isinstance(context, int) and context < 2**40 else None,
        "chat_template": chat_template(folder),
        "modalities": takes,
        "trainable": trainable(architecture, images=IMAGE in takes),
    }
