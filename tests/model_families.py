"""The model families people fine-tune, each declared once as a tiny random-init checkpoint with its real
chat template, for tests that must hold on every architecture (training, rendering, serving).

``FAMILIES[name]`` says how to build one: transformers' config class and tiny sizes (hidden 64, 2 layers;
MoE with 4 experts of width 32, 2 a token), the family's chat template as TRL ships it in
``trl/chat_templates/`` (read from the installed trl package when a model is built: never a template
written here), the name of TRL's training variant of that template (``{% generation %}`` markers) where
TRL has one, and the family's special tokens as its real tokenizer has them: BOS, the EOS that ends an
assistant turn in the template, the pad token (None where the real tokenizer has none, as Llama 3.1's and
Mistral's), the markers the template writes, and the tokens the real generation config stops on.

``build_family(name, out_dir)`` writes a real Hugging Face folder (``AutoModelForCausalLM`` and
``AutoTokenizer`` load it): the config with its architecture's own features switched on at tiny sizes
(Gemma 3's and gpt-oss's sliding windows of 16 tokens, so that short test rows cross them; Llama 3.1's,
Phi-3.5's and gpt-oss's RoPE scaling), and a byte-level BPE tokenizer trained as
``trainers.modeling.tiny_model``'s on the bundled corpus, with the family's special tokens added. Real
tokenizers of Gemma, Mistral and Phi are SentencePiece; a byte-level BPE stands in for all of them, since
what the tests need of a tokenizer is its special tokens and its template. The BPE is trained once per
process and copied for each family; a family builds in well under a second.

    python -c "from tests.model_families import build_family; print(build_family('qwen3', '/tmp/qwen3'))"
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import trl
from tokenizers import Tokenizer, processors
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from trainers.modeling.tiny_model import byte_level_bpe

TEMPLATES_DIR = Path(trl.__file__).parent / "chat_templates"

# the BPE's size before a family's special tokens: as trainers.modeling.tiny_model's (common words one token)
BASE_VOCAB = 512

# every family's shapes: 2 layers of width 64, 4 query heads of 16 over 2 key/value heads
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
}
# a window shorter than the test rows, so that sliding-window layers really slide
WINDOW = 16


@dataclass(frozen=True)
class FamilySpec:
    """One family: how to build its tiny checkpoint (the module's docstring)."""

    config_class: type[PretrainedConfig]
    config: Mapping[str, Any]  # the tiny sizes and the family's own switches (TINY's overrides)
    template: str  # a file of trl/chat_templates
    training_template: str | None  # TRL's {% generation %} variant of it, where TRL has one
    bos: str | None
    eos: str  # what ends an assistant turn in the template (the tokenizer's eos_token)
    pad: str | None  # None: the real tokenizer has no pad token
    markers: tuple[str, ...]  # the other special tokens the template writes
    generation_eos: tuple[str, ...]  # the real generation config's eos_token_id, in its order
    adds_bos: bool = False  # whether the real tokenizer prepends BOS when encoding text
    extra_special: tuple[str, ...] = field(default=())  # special tokens the template does not write

    @property
    def special_tokens(self) -> list[str]:
        """Every special token of the family, each once, in a stable order."""
        tokens = [self.bos, self.eos, self.pad, *self.markers, *self.generation_eos, *self.extra_special]
        return list(dict.fromkeys(t for t in tokens if t is not None))

    def chat_template(self) -> str:
        return (TEMPLATES_DIR / self.template).read_text(encoding="utf-8")

    def training_chat_template(self) -> str | None:
        if self.training_template is None:
            return None
        return (TEMPLATES_DIR / self.training_template).read_text(encoding="utf-8")


_QWEN_MARKERS = (
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
# Qwen2.5 Instruct: biased q/k/v projections (always, in Qwen2's modeling); the small sizes tie the
# embeddings. Its instruct models stop on <|im_end|> and on <|endoftext|> (their pad token), as Qwen3's
QWEN2_5 = FamilySpec(
    Qwen2Config,
    {"tie_word_embeddings": True},
    template="qwen2_5.jinja",
    training_template="qwen2_5_training.jinja",
    bos=None,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    markers=_QWEN_MARKERS,
    generation_eos=("<|im_end|>", "<|endoftext|>"),
)
# Qwen3: RMSNorm on each head's queries and keys, and <think> blocks in its template
QWEN3 = replace(
    QWEN2_5,
    config_class=Qwen3Config,
    template="qwen3.jinja",
    training_template="qwen3_training.jinja",
    markers=(*_QWEN_MARKERS, "<think>", "</think>"),
)

FAMILIES: dict[str, FamilySpec] = {
    # Llama 3.1 Instruct: RoPE scaled the "llama3" way. TRL has no training variant of the 3.1 template
    # (llama3_training.jinja patches Llama 3's, which renders no tools)
    "llama3.1": FamilySpec(
        LlamaConfig,
        {
            "max_position_embeddings": 131072,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
        template="llama3_1.jinja",
        training_template=None,
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad=None,
        markers=("<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"),
        generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        adds_bos=True,
        extra_special=("<|finetune_right_pad_id|>",),
    ),
    "qwen2.5": QWEN2_5,
    "qwen3": QWEN3,
    # Qwen3-MoE (30B-A3B's shape, tiny): every layer sparse, experts as fused 3-D parameters, a router
    # with normalised top-k weights; no router loss in training (output_router_logits off, as shipped)
    "qwen3-moe": replace(
        QWEN3,
        config_class=Qwen3MoeConfig,
        config={
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
    # Gemma 3 (text, as gemma-3-1b-it): norms scaling by 1 + weight, embeddings scaled by sqrt(hidden),
    # GELU MLP, q/k norms, sliding-window layers beside global ones, tied embeddings; its attention scale
    # is query_pre_attn_scalar ** -0.5 (the head size in the real models). No soft-capping in Gemma 3
    "gemma3": FamilySpec(
        Gemma3TextConfig,
        {
            "num_key_value_heads": 1,
            "query_pre_attn_scalar": 16,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        template="gemma3.jinja",
        training_template="gemma3_training.jinja",
        bos="<bos>",
        eos="<end_of_turn>",
        pad="<pad>",
        markers=("<start_of_turn>", "<start_of_image>"),
        generation_eos=("<eos>", "<end_of_turn>"),
        adds_bos=True,
    ),
    # Mistral 7B Instruct v0.2 (no sliding window since v0.2). TRL ships no Mistral template: the closest is
    # llava_next.jinja, the [INST] template of llava-v1.6-mistral-7b, whose language model is that Mistral.
    # It reads each message's content as a list of parts (content[0]['text']): a plain string renders empty
    "mistral": FamilySpec(
        MistralConfig,
        {"sliding_window": None},
        template="llava_next.jinja",
        training_template="llava_next_training.jinja",
        bos="<s>",
        eos="</s>",
        pad=None,
        markers=("[INST]", "[/INST]", "<image>"),
        generation_eos=("</s>",),
        adds_bos=True,
        extra_special=("<unk>",),
    ),
    # Phi-3.5-mini-instruct: fused qkv_proj and gate_up_proj, "longrope" RoPE scaling. The template ends
    # every turn with <|end|> (the turn's EOS) and a conversation without a generation prompt with
    # eos_token
    "phi3.5": FamilySpec(
        Phi3Config,
        {
            "num_key_value_heads": 4,
            "max_position_embeddings": 131072,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + i / 16 for i in range(8)],
                "long_factor": [2.0 + i / 4 for i in range(8)],
                "original_max_position_embeddings": 4096,
                "factor": 32.0,  # 131072 / 4096, what transformers derives from the real config
                "partial_rotary_factor": 1.0,
            },
        },
        template="phi3_5.jinja",
        training_template="phi3_5_training.jinja",
        bos="<s>",
        eos="<|end|>",
        pad="<|endoftext|>",
        markers=("<|system|>", "<|user|>", "<|assistant|>"),
        generation_eos=("<|end|>", "<|assistant|>", "<|endoftext|>"),
        extra_special=("<unk>",),
    ),
    # gpt-oss (20b's shape, tiny): MoE experts with biases and a clamped SwiGLU, a router with a bias,
    # attention sinks (a learned per-head logit; transformers runs it eager, not sdpa), biased attention
    # projections, alternating sliding and full layers, YaRN RoPE. The harmony format: an assistant turn
    # ends with <|return|> (last) or <|end|>, a tool call with <|call|>
    "gpt-oss": FamilySpec(
        GptOssConfig,
        {
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "max_position_embeddings": 131072,
        },
        template="gptoss.jinja",
        training_template="gptoss_training.jinja",
        bos="<|startoftext|>",
        eos="<|return|>",
        pad="<|endoftext|>",
        markers=("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|constrain|>"),
        generation_eos=("<|return|>", "<|endoftext|>", "<|call|>"),
    ),
}


@functools.cache
def _base_bpe() -> str:
    """The byte-level BPE every family starts from (serialised), trained once per process as the tiny
    model's is, with no special token."""
    serialised: str = byte_level_bpe(BASE_VOCAB, []).to_str()
    return serialised


def family_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """The family's tokenizer: the shared BPE, its special tokens (ids after the BPE's) and its template."""
    spec = FAMILIES[name]
    tok = Tokenizer.from_str(_base_bpe())
    tok.add_special_tokens(spec.special_tokens)
    if spec.adds_bos:
        assert spec.bos is not None
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A",
            pair=f"{spec.bos} $A {spec.bos} $B",
            special_tokens=[(spec.bos, tok.token_to_id(spec.bos))],
        )
    named = {"bos_token": spec.bos, "eos_token": spec.eos, "pad_token": spec.pad}
    named_tokens = {t for t in named.values() if t is not None}
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        **{key: value for key, value in named.items() if value is not None},
        additional_special_tokens=[t for t in spec.special_tokens if t not in named_tokens],
        chat_template=spec.chat_template(),
        model_max_length=TINY["max_position_embeddings"],
    )


def family_config(name: str, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    spec = FAMILIES[name]
    ids = _token_ids(tokenizer)
    return spec.config_class(
        **(
            TINY
            | dict(spec.config)
            | {
                "vocab_size": len(tokenizer),
                "bos_token_id": ids(spec.bos),
                "eos_token_id": ids(spec.eos),
                "pad_token_id": ids(spec.pad),
            }
        )
    )


def build_family(name: str, out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write family ``name``'s tiny model, tokenizer and generation config to ``out_dir``; return it.

    Deterministic for a given ``seed``; the caller's global RNG state is left untouched."""
    spec = FAMILIES[name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = family_tokenizer(name)
    config = family_config(name, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    ids = _token_ids(tokenizer)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=ids(spec.bos),
        eos_token_id=[ids(t) for t in spec.generation_eos],
        pad_token_id=ids(spec.pad),
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _token_ids(tokenizer: PreTrainedTokenizerFast) -> Any:
    def ids(token: str | None) -> int | None:
        if token is None:
            return None
        found = tokenizer.convert_tokens_to_ids(token)
        assert isinstance(found, int) and found != tokenizer.unk_token_id, token
        return found

    return ids
