"""The token-by-token sampler behind /v1/chat/completions (trainers/modeling/generation.py), on the tiny
model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainers.modeling.generation import (
    Generation,
    SamplingProcessor,
    chat_prompt_ids,
    load_causal_lm,
    load_with_adapter,
    pick_next,
    sample_by_cdf,
)

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def loaded(tiny_model_path: Path) -> tuple[Any, Any]:
    return load_causal_lm(tiny_model_path)


def _run(
    loaded: tuple[Any, Any], **kwargs: Any
) -> tuple[Generation, list[list[tuple[int, str, str | None]]]]:
    model, tokenizer = loaded
    n, stop = kwargs.pop("n", 1), kwargs.pop("stop", ())
    generation = Generation(tokenizer, n=n, stop=stop)
    steps = list(generation.run(model, chat_prompt_ids(tokenizer, CHAT), **kwargs))
    return generation, steps


def test_greedy_matches_transformers_generate(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    prompt = chat_prompt_ids(tokenizer, CHAT)
    reference = model.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id
    )[0, len(prompt) :].tolist()
    generation, _ = _run(loaded, max_new_tokens=12, temperature=0.0, top_p=1.0, seed=0)
    # our KV-cache loop picks the same tokens as transformers' own greedy search
    assert generation.choices[0].ids == reference[: len(generation.choices[0].ids)]
    assert generation.texts[0] == tokenizer.decode(generation.choices[0].ids, skip_special_tokens=True)


def test_the_prompt_step_computes_the_last_positions_logits_only(loaded: tuple[Any, Any]) -> None:
    """The head runs on one position a row, given contiguous (a strided view costs a copy of the head
    per row on the CPU: trainers/modeling/generation.py)."""
    model = loaded[0]
    seen: list[tuple[tuple[int, ...], bool]] = []
    hook = model.lm_head.register_forward_hook(
        lambda _head, args, _out: seen.append((tuple(args[0].shape), args[0].is_contiguous()))
    )
    try:
        _run(loaded, n=2, max_new_tokens=3, temperature=0.0, top_p=1.0, seed=0)
    finally:
        hook.remove()
    assert seen == [((2, 1, model.config.hidden_size), True)] * 3


def test_an_adapter_checkpoint_is_served_merged_into_its_base(tiny_model_path: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    base, tokenizer = load_causal_lm(tiny_model_path)
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):  # peft 0.21 on transformers 5
        adapted: Any = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # B starts at zero: an adapter that changes nothing proves nothing
    adapted.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ids = torch.tensor([chat_prompt_ids(tokenizer, CHAT)])
    with torch.no_grad():
        expected = adapted(input_ids=ids).logits
        with adapted.disable_adapter():
            plain = adapted(input_ids=ids).logits
    served, _ = load_with_adapter(tiny_model_path, tmp_path)
    assert not isinstance(served, PeftModel) and not served.training
    assert not any(isinstance(module, BaseTunerLayer) for module in served.modules())  # no adapter products
    with torch.no_grad():
        logits = served(input_ids=ids).logits
    assert (logits - expected).abs().max() < 1e-5 < (plain - expected).abs().max() / 1000


def test_streamed_pieces_add_up_and_length_is_reported(loaded: tuple[Any, Any]) -> None:
    generation, steps = _run(loaded, n=3, max_new_tokens=7, temperature=1.5, top_p=1.0, seed=3)
    for index in range(3):
        pieces = [text for step in steps for i, text, _ in step if i == index]
        assert "".join(pieces) == generation.texts[index]
        ends = [reason for step in steps for i, _, reason in step if i == index and reason]
        assert ends == [generation.finish_reasons[index]]
        assert ends[0] in ("stop", "length")
    # a choice that never hit EOS stopped at max_new_tokens: "length", with every token counted
    assert generation.completion_tokens == sum(len(c.ids) for c in generation.choices)
    for choice in generation.choices:
        assert (choice.finish_reason == "length") == (len(choice.ids) == 7)


def test_seed_reproduces_and_choices_differ(loaded: tuple[Any, Any]) -> None:
    first, _ = _run(loaded, n=4, max_new_tokens=10, temperature=1.5, top_p=1.0, seed=11)
    again, _ = _run(loaded, n=4, max_new_tokens=10, temperature=1.5, top_p=1.0, seed=11)
    other, _ = _run(loaded, n=4, max_new_tokens=10, temperature=1.5, top_p=1.0, seed=12)
    assert [c.ids for c in first.choices] == [c.ids for c in again.choices]
    assert [c.ids for c in first.choices] != [c.ids for c in other.choices]
    # the n rows of one batch are sampled independently
    assert len({tuple(c.ids) for c in first.choices}) > 1


def test_stop_string_cuts_the_text_and_is_never_streamed(loaded: tuple[Any, Any]) -> None:
    free, _ = _run(loaded, max_new_tokens=16, temperature=0.0, top_p=1.0, seed=0)
    text = free.texts[0]
    assert len(text) >= 6, text
    stop = text[3:6]
    cut, steps = _run(loaded, stop=[stop], max_new_tokens=16, temperature=0.0, top_p=1.0, seed=0)
    assert cut.texts[0] == text[: text.find(stop)]
    assert cut.finish_reasons == ["stop"]
    assert "".join(t for step in steps for _, t, _ in step) == cut.texts[0]


def test_nucleus_keeps_only_the_top_token_at_small_top_p() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]] * 64)
    generator = torch.Generator().manual_seed(0)
    picked = pick_next(logits, temperature=1.0, top_p=0.05, generator=generator)
    assert picked.tolist() == [1] * 64
    wide = pick_next(logits, temperature=1.0, top_p=1.0, generator=generator)
    assert set(wide.tolist()) > {1}
    assert pick_next(logits, temperature=0.0, top_p=1.0, generator=generator).tolist() == [1] * 64


def test_draws_follow_the_weights() -> None:
    """200,000 draws a row: each token's share within 5 standard errors of its probability, and a
    zero weight never drawn, whatever the row's sum."""
    weights = torch.tensor([[0.0, 0.5, 0.2, 0.0, 0.3], [3.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 7.0]])
    rows, draws = weights.size(0), 200_000
    generator = torch.Generator().manual_seed(0)
    picked = sample_by_cdf(weights.repeat_interleave(draws, dim=0), generator).view(rows, draws)
    shares = torch.stack([torch.bincount(row, minlength=5) for row in picked]).double() / draws
    expected = weights.double() / weights.double().sum(dim=1, keepdim=True)
    standard_error = (expected * (1 - expected) / draws).sqrt()
    assert ((shares - expected).abs() <= 5 * standard_error).all(), shares
    assert (shares[expected == 0] == 0).all()
    again = sample_by_cdf(weights, torch.Generator().manual_seed(0))
    assert torch.equal(again, sample_by_cdf(weights, torch.Generator().manual_seed(0)))


def test_generate_with_the_sampling_processor_samples_the_models_distribution(
    loaded: tuple[Any, Any],
) -> None:
    """Greedy search over the processor's scores samples the temperature-scaled, nucleus-cut softmax
    of the model's next-token logits: the first tokens of 4,000 rows against those probabilities."""
    model, tokenizer = loaded
    prompt = torch.tensor([chat_prompt_ids(tokenizer, CHAT)])
    with torch.no_grad():
        logits = model(input_ids=prompt).logits[0, -1]
    temperature, top_p, rows = 2.0, 0.9, 4_000
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    ranked, order = probs.sort(descending=True)
    kept = order[(ranked.cumsum(0) - ranked) < top_p]
    expected = torch.zeros_like(probs)
    expected[kept] = probs[kept] / probs[kept].sum()
    torch.manual_seed(0)
    out = model.generate(
        input_ids=prompt.repeat(rows, 1),
        do_sample=False,
        logits_processor=[SamplingProcessor(temperature=temperature, top_p=top_p)],
        max_new_tokens=1,
        pad_token_id=tokenizer.eos_token_id,
    )
    shares = torch.bincount(out[:, -1], minlength=probs.numel()).double() / rows
    assert (shares[expected == 0] == 0).all()  # nothing outside the nucleus
    assert len(kept) > 20  # a wide nucleus: the check below compares many tokens
    standard_error = (expected * (1 - expected) / rows).sqrt()
    assert ((shares - expected).abs() <= 5 * standard_error + 1e-9).all()
    # greedy search of the raw logits would give one token to every row
    assert (shares > 0).sum() > 20


class _CharTokenizer:
    """One token per character (id = code point), 0 = EOS: makes token boundaries explicit."""

    eos_token_id = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i)


def test_text_that_may_start_a_stop_string_is_held_back_until_it_does_not() -> None:
    def feed(text: str) -> tuple[Generation, list[tuple[str, str | None]]]:
        generation = Generation(_CharTokenizer(), n=1, stop=["END"])  # type: ignore[arg-type]
        out = [generation._advance(0, ord(c), {0}, last=False) for c in text]
        return generation, [(u[1], u[2]) for u in out if u is not None]

    _, pieces = feed("xyEN")
    assert pieces == [("x", None), ("y", None)]  # "EN" may begin "END": not sent yet
    generation, pieces = feed("xyENx")
    assert pieces[-1] == ("ENx", None)  # it did not: sent with the next character
    generation, pieces = feed("xyEND")
    assert pieces[-1] == ("", "stop") and generation.texts == ["xy"]


def test_a_choice_ended_by_its_reader_decodes_no_further(loaded: tuple[Any, Any]) -> None:
    """``end``: the reply has all it wants of a choice (its one tool call): its text stops there, the
    other choices go on, and the run ends with the last of them."""
    model, tokenizer = loaded
    generation = Generation(tokenizer, n=2, stop=())
    steps = generation.run(
        model, chat_prompt_ids(tokenizer, CHAT), max_new_tokens=8, temperature=0.0, top_p=1.0, seed=0
    )
    first = next(steps)
    generation.end(0, "tool_calls")
    rest = list(steps)
    assert [u[0] for u in first] == [0, 1]
    assert all(index == 1 for step in rest for index, _, _ in step)
    assert len(generation.choices[0].ids) == 1 and generation.finish_reasons[0] == "tool_calls"
    assert len(generation.choices[1].ids) == 8 or generation.finish_reasons[1] == "stop"


def test_a_chat_format_s_markers_are_kept_and_other_special_tokens_dropped() -> None:
    from tests.model_families import family_tokenizer
    from trainers.chat.formats import HARMONY
    from trainers.modeling.generation import marker_decoder

    tokenizer = family_tokenizer("gpt-oss")
    text = "<|channel|>final<|message|>Hi<|return|><|endoftext|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert marker_decoder(tokenizer, HARMONY.markers)(ids) == "<|channel|>final<|message|>Hi<|return|>"
    assert marker_decoder(tokenizer, ())(ids) == "finalHi"  # as skip_special_tokens has it
