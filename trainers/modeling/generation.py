"""Text generation with a trained checkpoint: the demo's greedy `chat_reply`, and the token-by-token
sampler behind `/v1/chat/completions` (worker/inference.py).

`stream_choices` samples `n` completions of one prompt in one batch (the prompt repeated `n` times, so
no padding is needed) with the KV cache, one decoding step at a time, and yields the text each choice
gained at that step: the API streams it as it comes. Stop strings are matched on decoded text, and text
that might be the start of a stop string (or half a UTF-8 character) is held back until it is not.
Special tokens are left out of the text, but for the markers a chat format reads (``keep``: gpt-oss's
``<|channel|>``, Llama's ``<|python_tag|>``), which ``trainers.chat.formats`` reads the reply from.
RL rollouts sample through `model.generate` instead (trainers/families/rollout.py): they need whole batches of
token ids and masks, not text as it is produced.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

# transformers 5.24 renamed a decoder's KV-cache argument and output `past_key_values` to `cache` (the
# old name warns until 5.40, and the suite turns warnings into errors)
_MAJOR_MINOR = tuple(int(part) for part in transformers.__version__.split(".")[:2])
KV_CACHE = "cache" if _MAJOR_MINOR >= (5, 24) else "past_key_values"


@contextmanager
def contiguous_head_input(model: torch.nn.Module) -> Iterator[None]:
    """The output head given a contiguous input for the block. A decoding loop's first forward
    (``generate``'s, ``Generation.run``'s) applies the head to the prompt's last position only
    (``hidden[:, -1:, :]``, a strided view), and a linear layer on a strided 3-D input runs as a batched
    product against the weight expanded over the batch, which the CPU copies first: for SmolLM2's head
    (49,152 × 576) and 8 rows, ~80x slower than the same product on a contiguous copy of the 8 hidden
    states in bf16 (torch 2.13)."""
    output_embeddings = getattr(model, "get_output_embeddings", None)  # a transformers model's method
    head = output_embeddings() if callable(output_embeddings) else None
    if not isinstance(head, torch.nn.Module):
        yield
        return
    handle = head.register_forward_pre_hook(lambda _head, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def load_causal_lm(path: str | Path) -> tuple[Any, PreTrainedTokenizerBase]:
    """Model (eval mode) and tokenizer from a Hugging Face folder, hub id or a single `.gguf` file
    (dequantized by transformers; needs the `gguf` package)."""
    location = Path(path)
    if location.suffix == ".gguf":
        tokenizer = AutoTokenizer.from_pretrained(location.parent, gguf_file=location.name)
        model: Any = AutoModelForCausalLM.from_pretrained(location.parent, gguf_file=location.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path)
    model.eval()
    return model, tokenizer


def load_with_adapter(base_path: str | Path, adapter_dir: str | Path) -> tuple[Any, PreTrainedTokenizerBase]:
    """A LoRA checkpoint (the adapter only) merged into its base model, and the checkpoint's tokenizer."""
    from peft import PeftModel

    base, _ = load_causal_lm(base_path)
    with warnings.catch_warnings():
        # peft 0.21 reads `model.is_gradient_checkpointing`, which transformers 5 deprecates (FutureWarning)
        warnings.filterwarnings(
            "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        adapted: Any = PeftModel.from_pretrained(base, str(adapter_dir))
    # merged into the base for good (this model only serves): a decoding step then runs one product per
    # adapted layer instead of the base's and the adapter's two, and none of peft's code around them
    model = adapted.merge_and_unload()
    model.eval()
    return model, AutoTokenizer.from_pretrained(adapter_dir)


@torch.no_grad()
def chat_reply(model_dir: str | Path, messages: list[dict[str, Any]], *, max_new_tokens: int = 32) -> str:
    """Greedy reply of the model in `model_dir` (a Hugging Face folder) to a chat, without special tokens."""
    model, tokenizer = load_causal_lm(model_dir)
    prompt = chat_prompt_ids(tokenizer, messages)
    generation = Generation(tokenizer, n=1, stop=())
    for _ in generation.run(model, prompt, max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0, seed=0):
        pass
    return generation.texts[0].strip()


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> list[int]:
    """The chat rendered by the tokenizer's template, with the assistant's generation prompt."""
    rendered: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return [int(t) for t in rendered["input_ids"]]


def marker_decoder(tokenizer: PreTrainedTokenizerBase, keep: Sequence[str]) -> Callable[[list[int]], str]:
    """Token ids to text without special tokens, except the tokens of ``keep`` (a chat format's markers
    that are special tokens of this tokenizer; those that are not are text anyway)."""
    if not keep:
        return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))
    added = tokenizer.get_added_vocab()
    kept = {added[m] for m in keep if m in added}
    special = set(tokenizer.all_special_ids)
    special |= {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    dropped = special - kept
    return lambda ids: str(tokenizer.decode([i for i in ids if i not in dropped], skip_special_tokens=False))


def stop_token_ids(model: Any, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """EOS of the tokenizer and of the generation config (chat models often end turns on another id)."""
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids


def pick_next(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    top_k: int = 0,
) -> torch.Tensor:
    """Next token per row of `logits` (B, V): argmax at temperature 0, else nucleus sampling
    (``generator`` None: torch's default one of the logits' device).

    Top-k (`top_k` > 0) first keeps the k most likely tokens; nucleus (Holtzman et al. 2019) then keeps
    the smallest set of tokens whose probability reaches `top_p` (the most likely token always stays),
    renormalise, sample.
    """
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return sample_by_cdf(probs, generator)


def sample_by_cdf(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of ``weights`` (B, V; not negative, any positive sum), drawn with probability
    proportional to its weight: the first index whose running sum passes a uniform draw times the row's
    sum. ``torch.multinomial`` draws one exponential variate per weight instead, which on the CPU took
    ~15x as long a decoding step for 8 rows of SmolLM2's 49,152 tokens as this (torch 2.13).
    The running sums are float64, so the rounding of 49,152 float32 additions does not shift them."""
    cumulative = weights.double().cumsum(dim=-1)
    draw = torch.rand(
        (*weights.shape[:-1], 1), generator=generator, device=weights.device, dtype=torch.float64
    )
    picked = torch.searchsorted(cumulative, draw * cumulative[..., -1:], right=True)
    picked = picked.clamp_(max=weights.size(-1) - 1)
    # a draw that rounds up to the row's sum would land past its last positive weight: never a zero one
    zero = weights.gather(-1, picked) <= 0
    return torch.where(zero, weights.argmax(dim=-1, keepdim=True), picked).squeeze(-1)


class SamplingProcessor:
    """A ``generate`` logits processor that samples (``pick_next``) and leaves only the sampled token
    finite, for greedy search to pick: ``generate``'s own sampling goes through ``torch.multinomial``
    (``sample_by_cdf`` says what that cost). Draws come from torch's default generator, which the
    caller seeds."""

    def __init__(self, *, temperature: float, top_p: float) -> None:
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        picked = pick_next(scores, temperature=self.temperature, top_p=self.top_p, generator=None)
        only = torch.full_like(scores, -float("inf"))
        return only.scatter_(-1, picked.unsqueeze(-1), 0.0)


@dataclass
class _Choice:
    """One completion being decoded: its tokens, the text already handed out, why it ended."""

    ids: list[int] = field(default_factory=list)
    sent: str = ""
    finish_reason: str | None = None


class Generation:
    """`n` completions of one prompt, decoded as they are sampled.

    `run` yields, at each step, `(index, new_text, finish_reason)` for each choice that gained text or
    ended there; afterwards `texts`, `finish_reasons` and `completion_tokens` hold the totals. `keep`:
    the special tokens to keep in the text (``marker_decoder``).
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, *, n: int, stop: Sequence[str], keep: Sequence[str] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.decode = marker_decoder(tokenizer, keep)
        self.stop = [s for s in stop if s]
        self.choices = [_Choice() for _ in range(n)]

    def end(self, index: int, reason: str) -> None:
        """End choice ``index`` now, with ``reason`` (its reader has all it wants of it): it decodes no
        further, and the run stops once every choice has ended."""
        self.choices[index].finish_reason = reason

    @property
    def texts(self) -> list[str]:
        return [c.sent for c in self.choices]

    @property
    def finish_reasons(self) -> list[str | None]:
        return [c.finish_reason for c in self.choices]

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.ids) for c in self.choices)

    def run(
        self,
        model: Any,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        prompt_inputs: dict[str, torch.Tensor] | None = None,
    ) -> Iterator[list[tuple[int, str, str | None]]]:
        """``prompt_inputs``: the model's other inputs for the prompt's rows, given to its first forward
        only (a vision model's pixels: ``trainers.modeling.vision.vision_prompt``)."""
        eos = stop_token_ids(model, self.tokenizer)
        device = next(model.parameters()).device
        generator = torch.Generator(device=device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        step_input = torch.tensor([prompt_ids] * len(self.choices), dtype=torch.long, device=device)
        past: Any = None
        with torch.no_grad(), contiguous_head_input(model):
            for step in range(max_new_tokens):
                # logits at each row's last position only: the prompt's others predict nothing here
                extra = {k: v.to(device) for k, v in (prompt_inputs or {}).items()} if step == 0 else {}
                out = model(
                    input_ids=step_input, use_cache=True, logits_to_keep=1, **{KV_CACHE: past}, **extra
                )
                past = getattr(out, KV_CACHE)
                # pick_next takes the logits in float32 itself
                next_ids = pick_next(
                    out.logits[:, -1, :], temperature=temperature, top_p=top_p, generator=generator
                )
                last = step == max_new_tokens - 1
                updates = []
                for index, token in enumerate(next_ids.tolist()):
                    update = self._advance(index, int(token), eos, last)
                    if update is not None:
                        updates.append(update)
                if updates:
                    yield updates
                if all(c.finish_reason for c in self.choices):
                    return
                # finished rows keep decoding (their tokens are ignored): the batch stays rectangular
                step_input = next_ids.unsqueeze(1)

    def _advance(
        self, index: int, token: int, eos: set[int], last: bool
    ) -> tuple[int, str, str | None] | None:
        choice = self.choices[index]
        if choice.finish_reason is not None:
            return None
        choice.ids.append(token)
        text = self.decode(choice.ids)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            choice.finish_reason, end = "stop", min(hits)
        elif token in eos:
            choice.finish_reason, end = "stop", len(text)
        elif last:
            choice.finish_reason, end = "length", len(text)
        else:
            end = len(text) - self._held_back(text)
        new = text[len(choice.sent) : end] if end > len(choice.sent) else ""
        choice.sent += new
        if new or choice.finish_reason:
            return index, new, choice.finish_reason
        return None

    def _held_back(self, text: str) -> int:
        """How many trailing characters to keep back: half a UTF-8 character (decoded as U+FFFD), or
        the longest tail that a stop string starts with."""
        if text.endswith("\ufffd"):
            return len(text) - len(text.rstrip("\ufffd"))
        longest = 0
        for s in self.stop:
            for size in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:size]):
                    longest = size
                    break
        return longest
