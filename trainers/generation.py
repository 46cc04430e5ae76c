"""Text generation with a trained checkpoint: used by the demo and smoke tests today, and the place
GRPO/PPO rollouts will grow from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@torch.no_grad()
def chat_reply(model_dir: str | Path, messages: list[dict[str, Any]], *, max_new_tokens: int = 32) -> str:
    """Greedy reply of the model in `model_dir` (a Hugging Face folder) to a chat, without special tokens."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # transformers' stubs type generate() and the chat template's dict loosely; Any keeps this readable
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    inputs: Any = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt_length = inputs["input_ids"].shape[1]
    return str(tokenizer.decode(output[0, prompt_length:], skip_special_tokens=True)).strip()
