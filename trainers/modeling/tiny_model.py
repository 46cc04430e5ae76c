"""Build a tiny Llama-architecture causal LM and its tokenizer, entirely offline.

The objective is a model small enough to train for a few steps on a CPU in tests and in the demo, yet a
real Hugging Face checkpoint: ``AutoModelForCausalLM.from_pretrained(dir)`` and
``AutoTokenizer.from_pretrained(dir)`` load it, ``generate()`` works, and the tokenizer carries a chat
template. The Llama architecture is used because transformers 5.x swaps in its own digit-splitting
tokenizer for Qwen2 checkpoints.

    python -c "from trainers.modeling.tiny_model import build_tiny_model;
    print(build_tiny_model('/tmp/tiny'))"
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from trainers.tiny_spec import BOS, CHAT_TEMPLATE, EOS, PAD, ROLE_TOKENS, SPECIAL_TOKENS

ASSETS_DIR = Path(__file__).parents[1] / "assets"
CORPUS_PATH = ASSETS_DIR / "tiny_corpus.txt"
DEMO_SFT_PATH = ASSETS_DIR / "demo_sft.jsonl"

# 512 = 256 byte symbols + 6 special tokens + ~250 merges: enough merges that common words are one token.
VOCAB_SIZE = 512


def byte_level_bpe(vocab_size: int, special_tokens: list[str]) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (``special_tokens`` first) trained on the bundled corpus
    and the demo data (the BPE trainer is deterministic)."""
    texts = CORPUS_PATH.read_text(encoding="utf-8").splitlines()
    texts += DEMO_SFT_PATH.read_text(encoding="utf-8").splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _train_tokenizer() -> PreTrainedTokenizerFast:
    tok = byte_level_bpe(VOCAB_SIZE, SPECIAL_TOKENS)
    # Like Llama tokenizers: encoding with special tokens prepends BOS; the chat template writes its own.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def build_tiny_model(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny Llama (2 layers, hidden 64) and its tokenizer to ``out_dir``; return the folder.

    Deterministic for a given ``seed``; the caller's global RNG state is left untouched.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
