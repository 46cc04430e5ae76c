"""The bundled tiny model's name and chat template, torch-free: the service lists them (GET /v1/models,
service/base_models/catalog.py) and trainers/modeling/tiny_model.py builds the model with them."""

from __future__ import annotations

TINY_MODEL_NAME = "tunehouse/tiny-llama"

BOS, EOS, PAD = "<|begin|>", "<|end|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS]

# Each turn is `<|role|>\ncontent<|end|>`; an assistant turn ends on the EOS token so generation stops
# there. No text follows `<|end|>`, so the trainable span of an assistant turn ends exactly on EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
