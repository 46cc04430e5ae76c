"""Peak training memory per device, from a model's config and a job's hyperparameters: torch-free, so the
API's pre-flight estimate (``POST /v1/fine_tuning/jobs/estimate``) computes it without a model loaded.

What one device holds at the peak of a step, by part:

- ``weights``: every parameter at its stored byte size (``weight_bytes``: 4 for fp32, 2 for a bf16 LoRA
  base, ~0.5 for a 4-bit base once QLoRA lands: one more ``weight_bytes`` value, nothing else changes) plus
  the trainable LoRA matrices in fp32;
- ``gradients`` and ``optimizer``: fp32, of the trainable parameters only (AdamW keeps two moments);
- ``activations``: what backward keeps of each decoder layer for the micro-batch's tokens (the per-layer
  vectors below), or only each layer's input with gradient checkpointing plus one layer recomputed;
- ``logits``: the LM head's chunk of float32 logits and its gradient (``trainers.losses.causal_lm`` never
  holds more than one chunk);
- ``reference``: the frozen copy of the policy a full-weight preference or RL job computes its reference
  with (a LoRA job's reference is the adapter-disabled base: nothing more).

A vision-language base (``trainers.modalities``) adds its vision tower and projector (``VisionShape``): their
weights always; their gradients, optimizer state and the tower's activations for its patches (``image
tokens x patches_per_image_token``) only where the job trains them (``train_vision_tower``,
``train_projector``: frozen by default, and a frozen tower keeps nothing for backward). The images' tokens
in the text are tokens of the sequences like any other (the estimate counts them in ``row_width``).

FSDP divides weights, gradients and optimizer state by the ranks; activations stay per rank.
The per-layer coefficients count the tensors autograd keeps in a Llama-style layer with
``trainers.kernels.activation_memory`` installed; ``tests/trainers/test_memory_model.py`` holds them to
measured peaks (within 25%), and ``bench/memory_estimate.py`` does so on SmolLM2.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from trainers.modalities import patches_per_image_token

Device = Literal["cpu", "cuda"]

# the LM head's logits chunk in elements (trainers.losses.causal_lm.CHUNK_ELEMENTS / CUDA_CHUNK_ELEMENTS):
# the same numbers, stated again because that module imports torch; the memory test fails if they part
HEAD_CHUNK_ELEMENTS: dict[Device, int] = {"cpu": 2**25, "cuda": 2**28}
FP32 = 4
ADAM_STATES = 2
# projections "all-linear" adapts in a Llama-style layer (q, k, v, o, gate, up, down)
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class VisionShape:
    """The parts of a vision-language config's ``vision_config`` that size its tower and projector."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    patches_per_token: float  # patches the tower encodes per image token of the text
    text_hidden_size: int
    embedding_params: int = 0  # the patch embedding, and learnt positions where the tower has them
    concatenates: bool = True  # the projector takes a token's patches side by side (Gemma 3 pools them)
    # Qwen2.5-VL's tower: attention's q, k and v one fused linear layer, a gated MLP (gate, up, down), and
    # a projector (its "merger") of two linear layers, the first at the side-by-side patches' width
    qwen: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any], text_hidden: int) -> VisionShape | None:
        vision = config.get("vision_config")
        if not isinstance(vision, Mapping) or not isinstance(vision.get("hidden_size"), int):
            return None
        layers = vision.get("num_hidden_layers", vision.get("depth"))
        hidden = int(vision["hidden_size"])
        patch = int(vision.get("patch_size") or 14)
        embedding = int(vision.get("num_channels", vision.get("in_channels", 3))) * patch * patch * hidden
        embedding *= int(vision.get("temporal_patch_size") or 1)  # Qwen's patches span two frames
        if isinstance(vision.get("image_size"), int):  # learnt positions (SigLIP); Qwen's are rotary
            embedding += (int(vision["image_size"]) // patch) ** 2 * hidden
        return cls(
            hidden_size=hidden,
            intermediate_size=int(vision.get("intermediate_size") or 4 * hidden),
            num_layers=int(layers) if isinstance(layers, int) else 0,
            patches_per_token=patches_per_image_token(config),
            text_hidden_size=text_hidden,
            embedding_params=embedding,
            concatenates=config.get("model_type") != "gemma3",
            qwen=config.get("model_type") == "qwen2_5_vl",
        )

    @property
    def tower_linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one tower layer: attention's four, the MLP's two (Qwen's:
        attention's fused qkv and output, the gated MLP's three)."""
        h, i = self.hidden_size, self.intermediate_size
        if self.qwen:
            return {"qkv": (h, 3 * h), "proj": (h, h), "gate": (h, i), "up": (h, i), "down": (i, h)}
        return {"q": (h, h), "k": (h, h), "v": (h, h), "o": (h, h), "fc1": (h, i), "fc2": (i, h)}

    @property
    def tower_params(self) -> int:
        norms = (2 if self.qwen else 4) * self.hidden_size  # two norms a layer (Qwen's RMSNorm: no bias)
        layer = sum(a * b + b for a, b in self.tower_linears.values()) + norms
        return self.num_layers * layer + self.embedding_params

    @property
    def projector_params(self) -> int:
        """The projection of a token's patch features (side by side, or pooled) into the language
        model's width."""
        width = round(self.hidden_size * self.patches_per_token) if self.concatenates else self.hidden_size
        if self.qwen:  # a norm, then width -> width -> the language model's
            return (
                self.hidden_size
                + width * width
                + width
                + width * self.text_hidden_size
                + self.text_hidden_size
            )
        return width * self.text_hidden_size


@dataclass(frozen=True)
class ModelShape:
    """The parts of a transformers config (``config.json``) that size a decoder's memory (a vision-language
    config's ``text_config``, and its ``vision``)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    vision: VisionShape | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """From a ``config.json`` dict; ``ValueError`` naming the first missing key."""
        text = config.get("text_config")
        if isinstance(text, Mapping):  # a vision-language model: its language model's config
            shape = cls.from_config({"tie_word_embeddings": config.get("tie_word_embeddings", False), **text})
            return replace(shape, vision=VisionShape.from_config(config, shape.hidden_size))
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(config.get(key), int):
                raise ValueError(f"model config has no integer {key!r}")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection of one layer."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def n_params(self) -> int:
        layer = sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden_size  # + 2 norms
        embeddings = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embeddings
        return self.num_layers * layer + embeddings + head + self.hidden_size


@dataclass(frozen=True)
class TrainingShape:
    """What a job's hyperparameters and data make of a step on one device."""

    lora: bool
    lora_r: int = 8
    lora_target_modules: tuple[str, ...] | None = None  # None: every projection ("all-linear")
    # bytes of one base weight as stored: 4 fp32, 2 bf16, 0.5 for a 4-bit (nf4) base
    weight_bytes: float = FP32
    compute_bytes: int = FP32  # the activations' dtype: 2 under bf16/fp16 autocast
    micro_batch_rows: int = 1  # rows of the largest micro-batch
    row_width: int = 1024  # its padded width in tokens
    micro_batch_targets: int = 1024  # trained (loss) positions of that micro-batch
    # the attention kernel takes the sequences' bounds (flash attention's varlen kernel on CUDA): no
    # [rows, 1, width, width] mask is built
    varlen_attention: bool = False
    # rows of unequal lengths (padding): sdpa needs a mask; rows all as wide as the batch run causal alone
    padded: bool = True
    gradient_checkpointing: bool = False
    reference: bool = False  # the method computes a reference policy
    ranks: int = 1
    sharded: bool = False  # fsdp: weights, gradients and optimizer state split over the ranks
    device: Device = "cpu"
    # a vision base: image tokens of the largest micro-batch, and what of the tower trains
    image_tokens: int = 0
    train_vision_tower: bool = False
    train_projector: bool = False


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device at a step's peak, by part; the API answers ``as_dict`` (the parts and their
    total) as its ``MemoryBreakdown``, whose fields tests/trainers/test_memory_model.py holds to these."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    reference: int

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, int]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "total": self.total}


def lora_params(model: ModelShape, job: TrainingShape) -> int:
    """Trainable parameters of the adapter: r x (in + out) per adapted projection per layer."""
    targets = job.lora_target_modules or _LINEARS
    per_layer = sum(job.lora_r * (a + b) for name, (a, b) in model.linear_shapes().items() if name in targets)
    return model.num_layers * per_layer


def _layer_activation_vectors(model: ModelShape, job: TrainingShape) -> float:
    """Elements per token that backward keeps of one decoder layer (``activation_memory`` installed):
    each RMSNorm's input (2 x hidden), q, k, v after RoPE and the attention output (q + 2 kv + q), the MLP's
    gate(x) and up(x) (2 x intermediate); a LoRA layer adds its low-rank intermediates (r per adapted
    projection)."""
    h, i = model.hidden_size, model.intermediate_size
    vectors = 2 * h + 2 * model.q_dim + 2 * model.kv_dim + 2 * i
    if job.lora:
        vectors += job.lora_r * len(job.lora_target_modules or _LINEARS)
    return float(vectors)


def _vision_parts(model: ModelShape, job: TrainingShape) -> tuple[int, int, float]:
    """A vision base's (parameters, trainable parameters, activation bytes) beyond its language model."""
    vision = model.vision
    if vision is None:
        return 0, 0, 0.0
    trainable = vision.projector_params if job.train_projector else 0
    activations = 0.0
    patches = job.image_tokens * vision.patches_per_token
    if job.train_vision_tower:
        if job.lora:  # LoRA on the tower's linear layers
            per_layer = sum(job.lora_r * (a + b) for a, b in vision.tower_linears.values())
            trainable += vision.num_layers * per_layer
        else:
            trainable += vision.tower_params
        # what backward keeps of a tower layer per patch: its norms' inputs, q, k, v, the attention's
        # output, the MLP's two (as a decoder layer keeps, without rotary), three where it is gated
        h, i = vision.hidden_size, vision.intermediate_size
        activations += (
            patches * vision.num_layers * (6 * h + (3 if vision.qwen else 2) * i) * job.compute_bytes
        )
    if job.train_projector:  # its input features, kept for its weight's gradient
        width = vision.hidden_size * (vision.patches_per_token if vision.concatenates else 1)
        activations += job.image_tokens * width * job.compute_bytes
    return vision.tower_params + vision.projector_params, trainable, activations


def estimate_memory(model: ModelShape, job: TrainingShape) -> MemoryEstimate:
    """Peak bytes per device of one training step (module docstring)."""
    vision_params, vision_trainable, vision_activations = _vision_parts(model, job)
    base_params = model.n_params
    share = job.ranks if job.sharded else 1
    if job.lora:
        trainable = lora_params(model, job) + vision_trainable
        weights = (base_params + vision_params) * job.weight_bytes + trainable * FP32
        reference = 0  # the adapter-disabled base
    else:
        trainable = base_params + vision_trainable
        weights = (base_params + vision_params) * FP32
        reference = (base_params + vision_params) * FP32 if job.reference else 0
    tokens = job.micro_batch_rows * job.row_width
    per_token = _layer_activation_vectors(model, job) * job.compute_bytes
    chunk_rows = max(1, min(job.micro_batch_targets, HEAD_CHUNK_ELEMENTS[job.device] // model.vocab_size))
    logits = 2 * chunk_rows * model.vocab_size * FP32  # a chunk's logits and their gradient
    if job.gradient_checkpointing:
        # each layer's input kept; in backward one layer at a time is rebuilt whole (no
        # activation_memory under checkpointing: + silu(gate) x up's two [tokens, intermediate] tensors
        # and the norms' outputs); its gradients take the place of what backward frees (the tiny model's
        # measured peaks fall within 0.9-1.25 of this)
        whole = per_token + (2 * model.intermediate_size + 2 * model.hidden_size) * job.compute_bytes
        rebuilt = math.ceil(tokens * whole)
        activations: float = tokens * model.num_layers * model.hidden_size * job.compute_bytes + rebuilt
        layer_phase = rebuilt
    else:
        activations = tokens * model.num_layers * per_token
        layer_phase = math.ceil(tokens * per_token)  # the last layer's gradients replace its activations
    # backward runs the head before any layer, and its logits are gone when the layers' gradients are
    # taken: the peak is the larger of the two phases, so `logits` is what the head's needs beyond a layer's
    logits = max(0, logits - layer_phase)
    if job.padded and not job.varlen_attention:
        # sdpa's mask for padded rows, built once per forward: a bool one and its float form
        activations += job.micro_batch_rows * job.row_width**2 * (1 + job.compute_bytes)
    # the embeddings' output and the final norm's input and output, kept at the decoder's ends
    activations += tokens * 3 * model.hidden_size * job.compute_bytes + vision_activations
    return MemoryEstimate(
        weights=math.ceil(weights / share),
        gradients=math.ceil(trainable * FP32 / share),
        optimizer=math.ceil(trainable * FP32 * ADAM_STATES / share),
        activations=math.ceil(activations),
        logits=logits,
        reference=math.ceil(reference / share),
    )


def precision_bytes(mixed_precision: str, device: Device) -> tuple[int, int]:
    """(activation bytes, LoRA base weight bytes) of a job's ``mixed_precision`` on ``device``: the rule of
    ``trainers.core.precision.autocast_dtype`` (bf16 autocast for ``auto`` on a GPU, only for an
    explicit ``bf16`` on a CPU; ``fp16`` on a CPU is fp32) and ``modeling.loading.load_model`` (a LoRA
    base is stored in bf16 only under bf16 autocast). A GPU without bf16 is taken to have it."""
    if mixed_precision == "no" or (device == "cpu" and mixed_precision != "bf16"):
        return FP32, FP32
    if mixed_precision == "fp16":
        return 2, FP32
    return 2, 2


def planned_steps(
    *, examples: int, batch_size: int, accumulation: int, ranks: int, epochs: int, max_steps: int | None
) -> int:
    """Optimizer steps of a run, as ``trainers.core.loop`` plans them: ceil(examples / batch) micro-batches
    an epoch, grouped by accumulation x ranks, times the epochs, capped at ``max_steps``."""
    micro = math.ceil(max(examples, 1) / batch_size)
    steps = math.ceil(micro / (accumulation * ranks)) * epochs
    return min(steps, max_steps) if max_steps else steps
