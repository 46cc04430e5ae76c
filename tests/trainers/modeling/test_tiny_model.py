"""The tiny model is a real, offline Hugging Face checkpoint with a chat template."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from trainers.modeling.tiny_model import build_tiny_model


def test_loads_and_generates(tiny_model_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert model.config.model_type == "llama"
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


def test_chat_template_renders(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|begin|><|system|>\nBe brief.<|end|><|user|>\nHi<|end|><|assistant|>\nHello<|end|>"
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert isinstance(prompt, str) and prompt.endswith("<|assistant|>\n")
    assert {tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token} == {
        "<|begin|>",
        "<|end|>",
        "<|pad|>",
    }
    assert tokenizer("Hi")["input_ids"][0] == tokenizer.bos_token_id


def test_deterministic_per_seed(tmp_path: Path, tiny_model_path: Path) -> None:
    again = load_file(build_tiny_model(tmp_path / "a", seed=0) / "model.safetensors")
    other = load_file(build_tiny_model(tmp_path / "b", seed=1) / "model.safetensors")
    first = load_file(tiny_model_path / "model.safetensors")
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tiny_model_path / "tokenizer.json"
    ).read_bytes()


def test_chat_reply_generates_text(tiny_model_path: Path) -> None:
    from trainers.modeling.generation import chat_reply

    reply = chat_reply(tiny_model_path, [{"role": "user", "content": "hello"}], max_new_tokens=4)
    # an untrained random model says something; the point is the template + generate + decode path
    assert isinstance(reply, str) and "<|" not in reply
