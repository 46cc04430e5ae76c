"""The frozen base of a LoRA run in 4 or 8 bits, through bitsandbytes (the ``quantization`` knob).

``nf4`` is QLoRA's recipe (Dettmers et al. 2023): every linear layer of the base but the output head
stored as 4-bit NormalFloat in blocks of 64 weights, the blocks' scales quantized again (double
quantization, about 0.4 bit per weight less), and each product run in the compute dtype on weights
dequantized on the fly. ``int8`` is LLM.int8 (Dettmers et al. 2022): row-wise 8-bit weights, inputs
quantized per row, outlier features in 16 bits. Embeddings, norms and the head stay in the dtype the
unquantized LoRA run holds its base in; the adapter trains in fp32, as without quantization.

What changes for the rest of the library is only the base layers' type (bitsandbytes' ``Linear4bit`` /
``Linear8bitLt``, wrapped by peft's own LoRA classes): the fused LoRA product and the merged-weight
sampling keep to plain ``nn.Linear`` bases and leave these to peft's forward; the disabled-adapter
reference is the quantized base, so DPO's and the RL methods' KL is to the model that is trained on.
The final checkpoint merges the adapter into the dequantized base (``trainers.core.checkpoint``).

The same bitsandbytes wheel runs on a CPU (its CPU backend: tests here) and on CUDA (its kernels).
"""

from __future__ import annotations

import torch
from transformers import BitsAndBytesConfig

# the blocks' own scales, quantized again: QLoRA's double quantization
_NF4 = {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}


def bnb_config(
    quantization: str | None, compute: torch.dtype, *, keep: list[str] | None = None
) -> BitsAndBytesConfig | None:
    """transformers' loading config for ``quantization`` (None: load unquantized). Products run in
    ``compute`` (the dequantized 4-bit weights' dtype). ``keep``: module names left unquantized instead
    of transformers' default (the output head); a sequence classifier's freshly initialised ``score``
    head must stay in full precision to train."""
    if quantization is None:
        return None
    if quantization == "nf4":
        return BitsAndBytesConfig(  # type: ignore[no-untyped-call]
            load_in_4bit=True, bnb_4bit_compute_dtype=compute, llm_int8_skip_modules=keep, **_NF4
        )
    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=keep)  # type: ignore[no-untyped-call]
    raise ValueError(f"quantization must be nf4, int8 or None, not {quantization!r}")
