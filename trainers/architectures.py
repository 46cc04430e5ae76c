"""What the trainers know of each transformers architecture (``model_type`` in a model's config.json):
which of our kernels fit it, what LoRA adapts on it, and which job features it cannot take.

Standard library only, so the service reads it too: ``problem`` is the one rule that refuses a feature an
architecture cannot take, at job creation (a 400 naming the hyperparameter: service/jobs/architecture.py)
and again in the trainer for a model whose config the service could not read (a hub id).

Our kernels assume Llama's structure; each entry says where an architecture has it. Where it has not, the
kernel steps aside for it and transformers' own forward runs (docs/model-families.md has the table):

- ``plain_head``: the logits are exactly ``lm_head(decoder(x))``, so the decoder may run alone: the LM
  head applied chunk by chunk (``trainers.losses.causal_lm.linear_cross_entropy``), and the decoder on
  packed rows (SFT without padding, the pair methods' and the rollouts' packed layouts). A config with a
  ``final_logit_softcapping`` (Gemma 2) never has a plain head (``trainers.modeling.loading``);
- ``packed_positions``: the decoder derives per-sequence attention from position ids that restart at 0
  (transformers' ``create_causal_mask(..., position_ids=...)``), so packed rows never attend to one
  another. gpt-oss's decoder builds its masks without the position ids (transformers 5.23), so packed
  rows would attend across sequences: ``packing`` is refused there and nothing packs implicitly;
- ``llama_layers``: each decoder layer's MLP is ``down(silu(gate(x)) * up(x))`` (gate and up one fused
  projection in Phi-3) and its norms are Llama's RMSNorm, which ``trainers.kernels.activation_memory``
  rebuilds in backward instead of keeping. Gemma 3 (norms scaling by ``1 + weight``, a GELU MLP) and the
  MoE layers keep transformers' forwards;
- ``lora_experts``: the mixture-of-experts weights LoRA adapts by default besides every linear layer but
  the head and the router. transformers 5 keeps a layer's experts as fused 3-D parameters, not linear
  layers, so LoRA reaches them through peft's ``target_parameters`` (rank r per expert); peft cannot
  apply dropout there, so ``lora_dropout`` must be 0 while the experts are adapted.

An architecture missing here gets ``UNKNOWN``: every kernel steps aside and no feature is refused.

>>> problem("gpt_oss", {"packing": True})[0]
'packing'
>>> problem("llama", {"packing": True}) is None
True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# the fused expert weights of transformers 5's MoE layers, as peft's ``target_parameters`` names them
MOE_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass(frozen=True)
class Architecture:
    """One architecture: what of it our kernels may assume (the module docstring)."""

    family: str  # the name people know it by
    plain_head: bool = False
    packed_positions: bool = True
    llama_layers: bool = False
    lora_experts: tuple[str, ...] = ()


UNKNOWN = Architecture("an architecture the trainers do not know")

ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("Llama 3.x", plain_head=True, llama_layers=True),
    "mistral": Architecture("Mistral", plain_head=True, llama_layers=True),
    "qwen2": Architecture("Qwen2.5", plain_head=True, llama_layers=True),
    "qwen3": Architecture("Qwen3", plain_head=True, llama_layers=True),
    "qwen3_moe": Architecture("Qwen3-MoE", plain_head=True, lora_experts=MOE_EXPERTS),
    "gemma3_text": Architecture("Gemma 3", plain_head=True),
    "phi3": Architecture("Phi-3, Phi-3.5 and Phi-4", plain_head=True, llama_layers=True),
    "gpt_oss": Architecture("gpt-oss", plain_head=True, packed_positions=False, lora_experts=MOE_EXPERTS),
}


def architecture(model_type: str | None) -> Architecture:
    return ARCHITECTURES.get(model_type or "", UNKNOWN)


def model_types(**wanted: bool) -> frozenset[str]:
    """The architectures whose fields have the ``wanted`` values, e.g. ``model_types(llama_layers=True)``."""
    return frozenset(
        name
        for name, arch in ARCHITECTURES.items()
        if all(getattr(arch, field) == value for field, value in wanted.items())
    )


def problem(model_type: str | None, values: Mapping[str, Any]) -> tuple[str, str] | None:
    """(hyperparameter, message) of the first feature ``values`` ask for (resolved hyperparameters by API
    name; an absent name asks for nothing) that architecture ``model_type`` cannot take, else None."""
    arch = architecture(model_type)
    if values.get("packing") and not arch.packed_positions:
        return "packing", (
            f"packing=True: {arch.family} models cannot train on packed rows (their attention masks ignore "
            "the packed sequences' bounds in transformers); set packing to false"
        )
    experts_adapted = values.get("lora") and values.get("lora_target_modules") is None and arch.lora_experts
    if experts_adapted and values.get("lora_dropout"):
        return "lora_dropout", (
            f"lora_dropout={values['lora_dropout']!r}: LoRA adapts the experts of {arch.family} models, "
            "which takes no dropout (peft cannot apply it to fused expert weights); set lora_dropout to 0, "
            "or name lora_target_modules to leave the experts out"
        )
    return None
