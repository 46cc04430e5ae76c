"""Load the model to train: base weights, optional LoRA adapter, device, precision. Installs no kernels:
``trainers.kernels.install.install_kernels`` does, called by ``trainers.families.entry.load_model_to_train``.

Shared by every method. Weights are kept in float32 for full fine-tuning (the optimizer updates fp32
master weights; mixed precision only changes the compute dtype, through autocast). A LoRA run on CUDA
with bf16 keeps the frozen base in bf16 and the adapter in fp32; with ``quantization`` its linear layers
are 4- or 8-bit (``trainers.modeling.quantization``). On resume, the trainable weights come from the
checkpoint's ``model/`` folder.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model, set_peft_model_state_dict
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.modeling_layers import GenericForSequenceClassification

from trainers.architectures import architecture, model_types
from trainers.core.checkpoint import MODEL_DIR, load_adapter_file
from trainers.core.distributed import local_device
from trainers.core.precision import autocast_dtype
from trainers.core.sharding import is_sharded
from trainers.data.packing import PackedLayout, PairPacking
from trainers.losses.causal_lm import linear_token_nll
from trainers.modeling.adapter_classifier import HEAD_KEY, AdapterClassifier
from trainers.modeling.quantization import bnb_config


class ModelSettings(Protocol):
    model_path: str
    use_lora: bool
    lora_r: int
    lora_alpha: int
    lora_dropout: float
    lora_target_modules: list[str] | None
    quantization: str | None
    gradient_checkpointing: bool
    mixed_precision: str
    resume_from: str | None


def pick_device() -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` on a GPU host (one device per rank), else the CPU."""
    return local_device()


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is always masked out, so any id will do
    return tokenizer


def model_type(model_path: str) -> str:
    """The architecture of the model at ``model_path`` (its config's ``model_type``), read without loading
    weights."""
    return str(AutoConfig.from_pretrained(model_path).model_type)


def load_model(
    settings: ModelSettings, device: torch.device, *, adapter_name: str = "default"
) -> torch.nn.Module:
    """Base model (+ LoRA adapter ``adapter_name``), with trainable weights restored from
    ``settings.resume_from``."""
    resume_model = Path(settings.resume_from) / MODEL_DIR if settings.resume_from else None
    if settings.use_lora:
        base_dtype = lora_base_dtype(settings, device)
        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
            settings.model_path, dtype=base_dtype, **_quantized(settings, base_dtype, device)
        )
        model = _add_lora(model, settings, adapter_name)
        if resume_model is not None:
            restore_adapter(model, resume_model, adapter_name)
    else:
        source = str(resume_model) if resume_model is not None else settings.model_path
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch.float32, **_quantized(settings, torch.float32, device)
        )
    return _to(model, device)


def lora_base_dtype(settings: ModelSettings, device: torch.device) -> torch.dtype:
    """The dtype a LoRA run keeps its frozen base in: bf16 where it computes in bf16, else float32."""
    compute = autocast_dtype(settings.mixed_precision, device)
    return torch.bfloat16 if compute == torch.bfloat16 else torch.float32


def _quantized(
    settings: ModelSettings, base_dtype: torch.dtype, device: torch.device, *, keep: list[str] | None = None
) -> dict[str, Any]:
    """``from_pretrained``'s arguments that load the base quantized, on ``device`` (bitsandbytes
    quantizes each weight where it lands); none without ``quantization``."""
    config = bnb_config(settings.quantization, base_dtype, keep=keep)
    if config is None:
        return {}
    if not settings.use_lora:  # the registry's constraint; a config built by hand may skip validate()
        raise ValueError("quantization needs use_lora: a quantized base cannot train")
    return {"quantization_config": config, "device_map": {"": device}}


def _to(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` on ``device`` (a quantized one was loaded there: bitsandbytes' 8-bit weights refuse to
    move). transformers' typed ``to`` rejects a device, hence ``nn.Module.to``."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    if getattr(base, "is_quantized", False):
        return model
    return torch.nn.Module.to(model, device)


def restore_adapter(model: PeftModel, folder: Path, adapter_name: str) -> None:
    """Adapter ``adapter_name``'s weights from a checkpoint's model folder (``adapter_model.safetensors``:
    one adapter, whatever it was named in the run that saved it)."""
    saved = load_adapter_file(folder)
    saved.pop(HEAD_KEY, None)  # a reward model's head: its own module (``AdapterClassifier.restore_head``)
    set_peft_model_state_dict(model, saved, adapter_name=adapter_name)


def lora_config(settings: ModelSettings, model: torch.nn.Module) -> LoraConfig:
    """The job's LoRA on ``model`` (``lora_targets``)."""
    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=settings.lora_r,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        **lora_targets(settings, model),
    )


def lora_targets(settings: ModelSettings, model: torch.nn.Module) -> dict[str, Any]:
    """What LoRA adapts: the job's ``lora_target_modules``; else every linear layer but the head (peft's
    "all-linear"), and on a mixture of experts (``Architecture.lora_experts``) the linear layers
    by name (the router is a parameter, not one) and the experts' fused weights as ``target_parameters``.
    Named rather than "all-linear" there: for architectures whose experts were linear layers in
    transformers 4 (Qwen3-MoE), peft 0.21 turns "all-linear" into those layers' fused successors and
    the router, and for the others (gpt-oss) it adapts the attention alone."""
    if settings.lora_target_modules:
        return {"target_modules": settings.lora_target_modules}
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    assert isinstance(base, PreTrainedModel)
    experts = architecture(base.config.model_type).lora_experts
    if not experts:
        return {"target_modules": "all-linear"}
    heads = {base.get_output_embeddings(), getattr(base, "score", None)}  # type: ignore[no-untyped-call]
    linear = {
        name.rsplit(".", 1)[-1]
        for name, module in base.named_modules()
        if isinstance(module, torch.nn.Linear) and module not in heads
    }
    return {"target_modules": sorted(linear), "target_parameters": list(experts)}


def _add_lora(model: torch.nn.Module, settings: ModelSettings, adapter_name: str = "default") -> PeftModel:
    config = lora_config(settings, model)
    with warnings.catch_warnings():
        # peft 0.21 reads `model.is_gradient_checkpointing`, which transformers 5 deprecates (FutureWarning).
        warnings.filterwarnings(
            "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        peft_model = get_peft_model(model, config, adapter_name=adapter_name)
    assert isinstance(peft_model, PeftModel)
    return peft_model


def load_sequence_classifier(
    settings: ModelSettings, device: torch.device, *, pad_token_id: int, num_labels: int = 1
) -> torch.nn.Module:
    """A sequence classifier (a reward model: ``num_labels=1``) on a causal LM checkpoint.

    The head (``score`` for Llama-style models) starts untrained, so with LoRA it is trained in full
    (peft's ``SEQ_CLS`` task saves it with the adapter). ``pad_token_id`` goes into the config: the model
    scores the last non-pad token of each row. Trainable weights come back from ``settings.resume_from``.
    """
    resume_model = Path(settings.resume_from) / MODEL_DIR if settings.resume_from else None
    source = str(resume_model) if resume_model is not None and not settings.use_lora else settings.model_path
    base_dtype = lora_base_dtype(settings, device) if settings.use_lora else torch.float32
    # the head starts untrained: it stays out of the quantized layers (it trains in full, as below)
    model: torch.nn.Module = AutoModelForSequenceClassification.from_pretrained(
        source,
        num_labels=num_labels,
        pad_token_id=pad_token_id,
        dtype=base_dtype,
        **_quantized(settings, base_dtype, device, keep=["score"]),
    )
    if settings.use_lora:
        config = LoraConfig(
            task_type=TaskType.SEQ_CLS,
            r=settings.lora_r,
            lora_alpha=settings.lora_alpha,
            lora_dropout=settings.lora_dropout,
            modules_to_save=["score"],
            **lora_targets(settings, model),  # the head trains in full, never through an adapter
        )
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
            model = get_peft_model(model, config)
        if resume_model is not None:
            set_peft_model_state_dict(model, load_adapter_file(resume_model))
        model.get_submodule("base_model.model.score").float()  # the head trains in fp32
    return _to(model, device)


def _unsharded_base(model: torch.nn.Module) -> PreTrainedModel | None:
    """The transformers model under a LoRA wrapper, if its logits are a plain head's
    (``PLAIN_HEAD_MODELS``, and no soft-capping of them) and it is not sharded (FSDP: weights are
    gathered only inside the model's own forward, ``trainers.core.sharding``)."""
    if is_sharded(model):
        return None
    if isinstance(model, AdapterClassifier):
        model = model.lm
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    if not isinstance(base, PreTrainedModel) or base.config.model_type not in PLAIN_HEAD_MODELS:
        return None
    if getattr(base.config, "final_logit_softcapping", None) is not None:  # tanh-capped logits (Gemma 2)
        return None
    return base


def runs_packed(model: torch.nn.Module) -> bool:
    """Whether the methods pack their batches for ``model`` without being asked (``trainers.data.packing``,
    ``PreferenceBatch.packed``, the rollouts' ``completion_layout``): where its decoder can run alone
    (``decoder_and_head``, ``classifier_parts``) and derives per-sequence attention from packed position
    ids (``Architecture.packed_positions``: transformers' ``create_causal_mask``)."""
    base = _unsharded_base(model)
    return base is not None and architecture(base.config.model_type).packed_positions


def pair_packing(model: torch.nn.Module) -> PairPacking:
    """How the pair methods run a preference batch through ``model``'s decoder: each pair's prompt once
    where its attention is sdpa, which takes ``shared_prompt_layout``'s boolean mask as it is (eager would
    add it to the scores, flash attention has no mask, flex wants a block mask), and no layer attends
    through a sliding window (a mask given whole is every layer's: transformers would not cut it to the
    window); else packed sequences where ``runs_packed``; else padded."""
    if not runs_packed(model):
        return PairPacking.PADDED
    base = _unsharded_base(model)
    assert base is not None
    if base.config._attn_implementation == "sdpa" and not slides(base.config):
        return PairPacking.SHARED_PROMPTS
    return PairPacking.SEQUENCES


def slides(config: PretrainedConfig) -> bool:
    """Whether some layer of a model of ``config`` attends through a sliding window (Gemma 3, gpt-oss, a
    Mistral or Qwen2 configured with one)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    return window is not None and (layer_types is None or "sliding_attention" in layer_types)


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """The causal LM's decoder (inputs → final hidden states) and its LM head, for the architectures
    whose logits are exactly ``hidden @ head.weight.T`` (``PLAIN_HEAD_MODELS``) with a bias-free head not
    adapted by LoRA. None otherwise (another architecture may scale or soft-cap its logits): the caller
    then runs the whole model. None as well for a sharded model."""
    base = _unsharded_base(model)
    if base is None or isinstance(model, AdapterClassifier):  # (a classifier: no LM head)
        return None
    head = base.get_output_embeddings()  # type: ignore[no-untyped-call]
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    return base.get_decoder(), head


class ClassifierParts(NamedTuple):
    decoder: torch.nn.Module
    head: torch.nn.Module  # hidden states -> scores
    pad_token_id: int  # the classifier scores each row's rightmost token that is not this id


def classifier_parts(model: torch.nn.Module) -> ClassifierParts | None:
    """A sequence classifier's decoder and its ``score`` head (LoRA's trained copy under a wrapper), for
    the ``PLAIN_HEAD_MODELS`` built on transformers' ``GenericForSequenceClassification``, whose forward
    is exactly ``score(decoder(x))`` pooled at the last non-pad token. None otherwise."""
    base = _unsharded_base(model)
    if isinstance(model, AdapterClassifier):  # the same parts on a shared causal LM
        return ClassifierParts(model.decoder, model.head, model.pad_token_id) if base is not None else None
    if not isinstance(base, GenericForSequenceClassification):
        return None
    pad_token_id = base.config.get_text_config().pad_token_id
    if not isinstance(pad_token_id, int):
        return None
    return ClassifierParts(getattr(base, base.base_model_prefix), base.score, pad_token_id)


def decoder_hidden_states(
    decoder: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    packed: PackedLayout | None = None,
) -> torch.Tensor:
    """[N, T, H] final hidden states of right-padded rows [N, T], computed on their packed layout when
    one is given (zeros at pad positions then)."""
    if packed is None:
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden: torch.Tensor = out.last_hidden_state
        return hidden
    return packed.unpack(packed_hidden_states(decoder, packed.pack(input_ids), packed))


def packed_hidden_states(
    decoder: torch.nn.Module, packed_ids: torch.Tensor, layout: PackedLayout
) -> torch.Tensor:
    """[R, W, H] final hidden states of the packed rows ``packed_ids`` [R, W] laid out by ``layout``."""
    # no cache, and no attention mask unless the layout brings one: transformers then derives
    # per-sequence attention from the position ids (a 4D mask it takes as it is)
    out = decoder(
        input_ids=packed_ids,
        position_ids=layout.position_ids,
        attention_mask=layout.attention_mask(),
        use_cache=False,
    )
    hidden: torch.Tensor = out.last_hidden_state
    return hidden


def target_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_mask: torch.Tensor,
    *,
    packed: PackedLayout | None = None,
    extra_inputs: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """[M] float32 log-probabilities of the target tokens of right-padded rows ``input_ids`` [N, T], in the
    row-major order of ``target_mask`` [N, T] (token t is a target predicted from positions < t; column 0
    never is). Only target positions get logits; on the architectures ``decoder_and_head`` knows, the
    head is applied chunk by chunk (``losses.linear_token_nll``), so their [M, V] logits are never held
    at once either, and the decoder runs on the ``packed`` layout when one is given. ``extra_inputs``:
    the model's other inputs (a vision model's pixels, ``trainers.data.vision``)."""
    mask = target_mask[:, 1:]
    targets = input_ids[:, 1:][mask]
    split = decoder_and_head(model)
    if split is None:
        logits: torch.Tensor = model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **(extra_inputs or {})
        ).logits
        return logits[:, :-1][mask].float().log_softmax(dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    decoder, head = split
    hidden = decoder_hidden_states(decoder, input_ids, attention_mask, packed)
    nll, _ = linear_token_nll(hidden[:, :-1][mask], head.weight, targets)
    return -nll


def row_sums(values: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """[N] sums per row of ``values`` [M], laid out as ``target_log_probs`` returns them."""
    mask = target_mask[:, 1:]
    rows = torch.arange(mask.shape[0], device=mask.device).unsqueeze(1).expand_as(mask)[mask]
    return torch.zeros(mask.shape[0], device=values.device, dtype=values.dtype).index_add(0, rows, values)


# transformers architectures whose forward computes ``logits = self.lm_head(hidden_states)`` and nothing
# more (``Architecture.plain_head``); others keep the whole-model path
PLAIN_HEAD_MODELS = model_types(plain_head=True)


def reward_scores(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    packed: PackedLayout | None = None,
) -> torch.Tensor:
    """[N] float32 scores of right-padded rows (the head's output at each row's last non-pad token); the
    decoder runs on the ``packed`` layout when one is given and the model's parts allow it."""
    parts = classifier_parts(model) if packed is not None else None
    if parts is None:
        logits: torch.Tensor = model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).logits
        return logits.squeeze(-1).float()
    hidden = decoder_hidden_states(parts.decoder, input_ids, attention_mask, packed)
    # the token transformers' classifier pools: the rightmost one whose id is not the pad id
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = (positions * (input_ids != parts.pad_token_id)).argmax(-1)
    pooled = hidden[torch.arange(input_ids.shape[0], device=input_ids.device), last]
    score: torch.Tensor = parts.head(pooled)
    return score.squeeze(-1).float()
