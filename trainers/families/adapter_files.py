"""An adapter host's state (trainers/families/adapter_host.py: `{"spec", "weights"}`) as a peft adapter
folder and back: how a Tinker checkpoint becomes a model that inference and jobs load (adapter_config.json
+ adapter_model.safetensors, peft's own layout), and how a job's LoRA checkpoint becomes a state a
training client loads.

A job's adapter may scale by `lora_alpha / r` (16 / 8 by default); a training client scales by 1
(alpha = r), so `read_adapter_folder` multiplies each `lora_B` by alpha / r: the adapted layers compute
exactly what the job's did.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from trainers.families.adapter_host import ATTENTION, MLP, UNEMBED, AdapterSpec, HostError, lora_config

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def write_adapter_folder(folder: Path, state: dict[str, Any]) -> None:
    """The state's adapter as a peft folder (no tokenizer: the caller adds its base's)."""
    folder.mkdir(parents=True, exist_ok=True)
    lora_config(AdapterSpec(**state["spec"])).save_pretrained(str(folder))
    save_file({k: v.contiguous() for k, v in state["weights"].items()}, str(folder / WEIGHTS_FILE))


def read_adapter_folder(folder: Path) -> dict[str, Any]:
    """A peft LoRA folder as a state a training client loads (weights only, no optimizer). HostError
    (naming `path`) for what a training client cannot hold: other peft types, DoRA, rsLoRA, trained heads
    (`modules_to_save`), modules other than attention, MLP and the unembedding."""
    config_path = folder / CONFIG_FILE
    if not config_path.exists() or not (folder / WEIGHTS_FILE).exists():
        raise HostError("path: this checkpoint holds full weights, not a LoRA adapter")
    config = json.loads(config_path.read_text())
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
        raise HostError("path: only plain LoRA adapters load into a training client (not DoRA or rsLoRA)")
    if config.get("modules_to_save"):
        raise HostError("path: this adapter trains whole modules too (modules_to_save); it cannot load")
    targets = config.get("target_modules") or []
    # a job names modules in full (`model.layers.0.mlp.down_proj`): the kind is the last part; a client
    # adapts every module of a kind, and those the job did not adapt add nothing (load_state zeroes them)
    targets = {t.rsplit(".", 1)[-1] for t in ([targets] if isinstance(targets, str) else targets)}
    unknown = targets - set(ATTENTION + MLP + UNEMBED)
    if unknown:
        raise HostError(f"path: this adapter adapts modules a training client has not: {sorted(unknown)}")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    spec = AdapterSpec(
        rank=rank,
        train_attn=bool(targets & set(ATTENTION)),
        train_mlp=bool(targets & set(MLP)),
        train_unembed=bool(targets & set(UNEMBED)),
    )
    weights = load_file(str(folder / WEIGHTS_FILE))
    scale = alpha / rank
    weights = {k: v * scale if "lora_B" in k else v for k, v in weights.items()}
    return {"spec": spec.__dict__, "weights": weights}
