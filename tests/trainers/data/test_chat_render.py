"""trainers/data/chat.py under the real chat templates of the families people train (TRL ships them in
trl/chat_templates/; none is written here): what trains is what the model produces after the prompt it
is given at inference, in that prompt's context; what a template cannot render is refused, naming the
field; and the trained text is TRL's ``assistant_only_loss`` text wherever TRL's does not differ by
design (each difference is asserted below and documented in docs/data-formats.md).

The tiny model's tokenizer carries each template here (the text is the template's, the tokens are the
tiny BPE's); tests/trainers/test_model_families.py trains each family's own tiny model and tokenizer."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trl
from transformers import PreTrainedTokenizerBase
from trl.chat_template_utils import get_training_chat_template

from tests.chat_rows import CALL, WEATHER
from trainers.chat.rows import Conversation, read_chat
from trainers.core.errors import DataError
from trainers.data.chat import ChatDataError, render, training_sequences
from trainers.data.file_stats import sft_file_stats
from trainers.data.preference import tokenize_preference_rows
from trainers.data.sft import tokenize_sft_rows
from trainers.families.rollout import tokenize_rl_rows

TEMPLATES = Path(trl.__file__).parent / "chat_templates"
ROWS: dict[str, dict[str, Any]] = {
    "multi-turn": {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Goodbye!"},
        ]
    },
    "reasoning": {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Sunny.", "reasoning": "Look outside."},
        ]
    },
    "tool calls": {
        "tools": [WEATHER],
        "messages": [
            {"role": "developer", "content": "You help."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'},
            {"role": "assistant", "content": "It is 20 degrees."},
        ],
    },
    "legacy functions": {
        "functions": [WEATHER["function"]],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}],
            },
            {"role": "assistant", "content": None, "function_call": CALL["function"]},
            {"role": "function", "name": "get_weather", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
        ],
    },
}
# family template -> row kind -> the field of the refusal (absent: it trains)
REFUSED: dict[str, dict[str, str]] = {
    "qwen3": {},
    "gptoss": {},
    "qwen2_5": {"reasoning": "messages[1].reasoning_content"},
    "llama3_1": {"reasoning": "messages[1].reasoning_content"},
    "gemma3": {
        "reasoning": "messages[1].reasoning_content",
        "tool calls": "messages[2].tool_calls[0]",
        "legacy functions": "messages[1].tool_calls[0]",
    },
    "phi3_5": {
        "reasoning": "messages[1].reasoning_content",
        "tool calls": "messages[2].tool_calls[0]",
        "legacy functions": "messages[1].tool_calls[0]",
    },
    # Mistral's [INST] format as llava-v1.6-mistral ships it: content only as parts, no tools
    "llava_next": {
        "reasoning": "messages[1].reasoning_content",
        "tool calls": "messages[2]",
        "legacy functions": "messages[1]",
    },
    "deepseek_r1_distill": {kind: "messages[2]" for kind in ROWS}
    | {"reasoning": "messages[1]", "legacy functions": "messages[1]"},
}


@pytest.fixture(scope="module")
def with_template(tokenizer: PreTrainedTokenizerBase) -> Callable[[str], PreTrainedTokenizerBase]:
    made: dict[str, PreTrainedTokenizerBase] = {}

    def make(name: str) -> PreTrainedTokenizerBase:
        if name not in made:
            made[name] = copy.deepcopy(tokenizer)
            made[name].chat_template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
        return made[name]

    return make


def chat_of(row: dict[str, Any]) -> Conversation:
    return read_chat(row["messages"], "messages", tools_from=row)


def trained_runs(sequences: list[list[tuple[str, bool]]]) -> list[str]:
    return [text for sequence in sequences for text, trained in sequence if trained]


CASES = [(template, kind) for template in REFUSED for kind in ROWS]


@pytest.mark.parametrize(("template", "kind"), CASES, ids=[f"{t}-{k}" for t, k in CASES])
def test_each_turn_trains_what_the_model_produces_in_its_inference_context(
    template: str, kind: str, with_template: Callable[[str], PreTrainedTokenizerBase]
) -> None:
    """Every trained span is exactly what the template renders for the turn after the generation
    prompt it gives for it, preceded by exactly that prompt — or the row is refused, naming the field."""
    tokenizer, chat = with_template(template), chat_of(ROWS[kind])
    if kind in REFUSED[template]:
        with pytest.raises(ChatDataError) as info:
            training_sequences(tokenizer, chat)
        assert info.value.field == REFUSED[template][kind], info.value
        return
    sequences = training_sequences(tokenizer, chat)
    turns = [i for i, w in enumerate(chat.weights) if w]
    spans = [
        (s, k) for s, sequence in enumerate(sequences) for k, (_, trained) in enumerate(sequence) if trained
    ]
    assert len(spans) == len(turns)
    for i, (s, k) in zip(turns, spans, strict=True):
        before = "".join(text for text, _ in sequences[s][:k])
        prompt = render(tokenizer, chat, i, generation_prompt=True)
        upto = render(tokenizer, chat, i + 1, generation_prompt=False)
        assert before == prompt
        assert prompt + sequences[s][k][0] in (upto, upto.removesuffix(str(tokenizer.eos_token)))


def test_prefix_stable_templates_train_a_conversation_in_one_sequence(
    with_template: Callable[[str], PreTrainedTokenizerBase],
) -> None:
    counts = {
        (t, k): len(training_sequences(with_template(t), chat_of(ROWS[k])))
        for t, k in CASES
        if k not in REFUSED[t]
    }
    assert counts == {
        # Qwen3 drops earlier turns' reasoning, and writes a turn after the last user message with a
        # <think> block (empty without reasoning) only while it is the last: each turn trains in a
        # sequence of its own, with the block the model produces
        ("qwen3", "multi-turn"): 2,
        ("qwen3", "reasoning"): 2,
        ("qwen3", "tool calls"): 2,
        ("qwen3", "legacy functions"): 2,
        # gpt-oss ends a final answer with <|return|> only in the last turn
        ("gptoss", "multi-turn"): 2,
        ("gptoss", "reasoning"): 2,
        ("gptoss", "tool calls"): 1,
        ("gptoss", "legacy functions"): 1,
        ("qwen2_5", "multi-turn"): 1,
        ("qwen2_5", "tool calls"): 1,
        ("qwen2_5", "legacy functions"): 1,
        ("llama3_1", "multi-turn"): 1,
        ("llama3_1", "tool calls"): 1,
        ("llama3_1", "legacy functions"): 1,
        ("gemma3", "multi-turn"): 1,
        # Phi-3.5 writes EOS after the last turn only: earlier turns end at their <|end|> in one sequence
        ("phi3_5", "multi-turn"): 1,
        ("llava_next", "multi-turn"): 1,
    }


@pytest.mark.parametrize("template", ["qwen3", "gptoss", "qwen2_5", "llama3_1"])
def test_tool_schemas_land_in_the_untrained_prompt_and_the_calls_train(
    template: str, with_template: Callable[[str], PreTrainedTokenizerBase]
) -> None:
    sequences = training_sequences(with_template(template), chat_of(ROWS["tool calls"]))
    untrained = "".join(t for s in sequences for t, trained in s if not trained)
    trained = "".join(trained_runs(sequences))
    assert "The weather in a city" in untrained and "The weather in a city" not in trained
    assert "get_weather" in trained and "Paris" in trained  # the call, with its arguments
    assert "20" in untrained and "It is 20 degrees." in trained  # the tool's result is context


def test_reasoning_trains_where_the_family_puts_it(
    with_template: Callable[[str], PreTrainedTokenizerBase],
) -> None:
    qwen3 = trained_runs(training_sequences(with_template("qwen3"), chat_of(ROWS["reasoning"])))
    assert qwen3 == [
        "<think>\nA greeting.\n</think>\n\nHello!<|im_end|>\n",
        "<think>\nLook outside.\n</think>\n\nSunny.<|im_end|>\n",
    ]
    gptoss = trained_runs(training_sequences(with_template("gptoss"), chat_of(ROWS["reasoning"])))
    final = "<|end|><|start|>assistant<|channel|>final<|message|>"
    assert gptoss == [
        f"<|channel|>analysis<|message|>A greeting.{final}Hello!<|return|>",
        f"<|channel|>analysis<|message|>Look outside.{final}Sunny.<|return|>",
    ]


def trl_runs(tokenizer: PreTrainedTokenizerBase, chat: Conversation) -> list[str]:
    """The assistant-only runs SFT with TRL's ``assistant_only_loss`` trains: the conversation once,
    through TRL's training template (``{% generation %}`` markers), given the same messages."""
    training = get_training_chat_template(tokenizer)
    out: Any = tokenizer.apply_chat_template(
        chat.messages,
        tools=chat.tools,
        chat_template=training,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    runs, current = [], []
    for token, masked in zip(out["input_ids"], out["assistant_masks"], strict=True):
        if masked:
            current.append(token)
        elif current:
            runs, current = [*runs, tokenizer.decode(current)], []
    return runs + ([tokenizer.decode(current)] if current else [])


TRL_CASES = [
    (t, k) for t in ("qwen3", "qwen2_5", "gemma3", "phi3_5", "gptoss") for k in ROWS if k not in REFUSED[t]
]


@pytest.mark.parametrize(("template", "kind"), TRL_CASES, ids=[f"{t}-{k}" for t, k in TRL_CASES])
def test_the_trained_text_is_trls_but_for_what_the_model_never_produces(
    template: str, kind: str, with_template: Callable[[str], PreTrainedTokenizerBase]
) -> None:
    """Ours equals TRL's run for run, except (a) where TRL's markers open inside the generation prompt
    (Qwen2.5's newline after ``<|im_start|>assistant``, gpt-oss's ``<|start|>assistant``): that text is
    the prompt's, given at inference, so it does not train here; and (b) gpt-oss's turns before the last:
    rendered once, TRL trains them as the template writes them for the context of later turns, without
    their analysis and ending ``<|end|>``; here each trains as the model produces it, with its analysis
    and ``<|return|>``."""
    tokenizer, chat = with_template(template), chat_of(ROWS[kind])
    ours = trained_runs(training_sequences(tokenizer, chat))
    theirs = trl_runs(tokenizer, chat)
    assert len(ours) == len(theirs)
    turns = [i for i, w in enumerate(chat.weights) if w]
    for i, mine, trl_run in zip(turns, ours, theirs, strict=True):
        prompt = render(tokenizer, chat, i, generation_prompt=True)
        if template == "gptoss" and i != turns[-1] and "tool_calls" not in chat.messages[i]:
            answer = chat.messages[i]["content"]
            assert trl_run == f"<|start|>assistant<|channel|>final<|message|>{answer}<|end|>"
            assert mine.endswith(f"<|channel|>final<|message|>{answer}<|return|>")
            continue
        cue = trl_run[: len(trl_run) - len(mine)]
        assert trl_run.endswith(mine) and prompt.endswith(cue), (mine, trl_run)
        assert cue in {"", "\n", "<|start|>assistant"}


def test_rows_a_template_cannot_render_fail_naming_line_and_field(
    with_template: Callable[[str], PreTrainedTokenizerBase],
) -> None:
    rows = [ROWS["multi-turn"], ROWS["tool calls"]]
    with pytest.raises(DataError) as info:
        tokenize_sft_rows(rows, with_template("gemma3"), max_length=512)
    assert info.value.param == "training_file"
    assert info.value.message.startswith("line 2: field 'messages[2].tool_calls[0]': ")
    with pytest.raises(
        DataError, match=r"^line 2: field 'messages\[2\].tool_calls\[0\]'"
    ):  # the estimate's own walk
        sft_file_stats(rows, with_template("gemma3"), max_length=512, batch_size=2)


def test_a_multi_turn_row_trains_as_its_sequences_and_the_estimate_counts_them(
    with_template: Callable[[str], PreTrainedTokenizerBase],
) -> None:
    tokenizer = with_template("qwen3")
    rows = [ROWS["reasoning"], ROWS["multi-turn"]]
    examples = list(tokenize_sft_rows(rows, tokenizer, max_length=512))
    assert len(examples) == 4  # each row's two turns in sequences of their own
    stats = sft_file_stats(rows, tokenizer, max_length=512, batch_size=2)
    assert (stats.examples, stats.trained_examples) == (2, 4)
    assert stats.tokens_per_epoch == sum(len(e.input_ids) for e in examples)
    previewed = ["".join(s["text"] for s in p if s["trained"]) for p in stats.preview]
    assert "A greeting." in previewed[0] and "Look outside." not in previewed[0]
    assert "Look outside." in previewed[1] and "A greeting." not in previewed[1]


def test_preference_pairs_with_tool_calls_prefer_the_call(
    with_template: Callable[[str], PreTrainedTokenizerBase],
) -> None:
    tokenizer = with_template("qwen3")
    row = {
        "input": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]},
        "preferred_output": [{"role": "assistant", "content": None, "tool_calls": [CALL]}],
        "non_preferred_output": [{"role": "assistant", "content": "No idea."}],
    }
    [pair] = tokenize_preference_rows([row], tokenizer, max_length=1024)
    prompt, chosen = tokenizer.decode(pair.prompt_ids), tokenizer.decode(pair.chosen_ids)
    assert "The weather in a city" in prompt and prompt.endswith("<|im_start|>assistant\n")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert chosen == f"<think>\n\n</think>\n\n{call}<|im_end|>\n"
    assert tokenizer.decode(pair.rejected_ids) == "<think>\n\n</think>\n\nNo idea.<|im_end|>\n"


TOOL_PAIR = {
    "input": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]},
    "preferred_output": [{"role": "assistant", "content": None, "tool_calls": [CALL]}],
    "non_preferred_output": [{"role": "assistant", "content": "No idea."}],
}
REASONING_PAIR = {
    "prompt": [{"role": "user", "content": "2 + 2?"}],
    "chosen": [{"role": "assistant", "content": "4", "reasoning_content": "Two and two."}],
    "rejected": [{"role": "assistant", "content": "5", "reasoning_content": "Guess."}],
}
TOOL_PROMPT = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER]}
# the other methods' rows under each template: what each reader refuses, by field (absent: it reads)
OTHER_REFUSED: dict[str, dict[str, str]] = {
    "qwen3": {},
    "gptoss": {},
    "qwen2_5": {"reasoning pair": "chosen[0].reasoning_content"},
    "llama3_1": {"reasoning pair": "chosen[0].reasoning_content"},
    # a pair's prompt renders first: where the template leaves the tools out, that is what is named
    "gemma3": {
        "tool pair": "input.tools",
        "reasoning pair": "chosen[0].reasoning_content",
        "tool prompt": "tools",
    },
    "phi3_5": {
        "tool pair": "input.tools",
        "reasoning pair": "chosen[0].reasoning_content",
        "tool prompt": "tools",
    },
    "llava_next": {
        "tool pair": "input.tools",
        "reasoning pair": "chosen[0].reasoning_content",
        "tool prompt": "tools",
    },
    "deepseek_r1_distill": {
        "tool pair": "input.tools",
        "reasoning pair": "chosen[0]",
        "tool prompt": "tools",
    },
}
OTHER_ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "tool pair": ("dpo", TOOL_PAIR),
    "reasoning pair": ("dpo", REASONING_PAIR),
    "tool prompt": ("grpo", TOOL_PROMPT),
}
OTHER_CASES = [(t, k) for t in OTHER_REFUSED for k in OTHER_ROWS]


@pytest.mark.parametrize(("template", "kind"), OTHER_CASES, ids=[f"{t}-{k}" for t, k in OTHER_CASES])
def test_preference_pairs_and_rl_prompts_read_or_refuse_by_field(
    template: str, kind: str, with_template: Callable[[str], PreTrainedTokenizerBase]
) -> None:
    """A preference pair with a preferred tool call or reasoning, and an RL prompt with tools, under each
    template: read (a pair's completions hold the call or the reasoning; a prompt holds the tools'
    schemas), or refused naming the line and field."""
    tokenizer = with_template(template)
    method, row = OTHER_ROWS[kind]
    refused = OTHER_REFUSED[template].get(kind)

    def read() -> str:
        if method == "dpo":
            [pair] = tokenize_preference_rows([row], tokenizer, max_length=2048)
            return tokenizer.decode(pair.chosen_ids)
        [prompt] = tokenize_rl_rows([row], tokenizer, max_prompt_length=2048)
        return prompt.text

    if refused is not None:
        with pytest.raises(DataError) as info:
            read()
        assert info.value.message.startswith(f"line 1: field {refused!r}: "), info.value.message
        return
    text = read()
    expected = {
        "tool pair": "get_weather",
        "reasoning pair": "Two and two.",
        "tool prompt": "The weather in a city",
    }
    assert expected[kind] in text


FAMILY_TEMPLATE = {
    "qwen3": "qwen3",
    "qwen2.5": "qwen2_5",
    "gemma3": "gemma3",
    "phi3.5": "phi3_5",
    "gpt-oss": "gptoss",
}
TOKEN_CASES = [(f, k) for f, t in FAMILY_TEMPLATE.items() for k in ROWS if k not in REFUSED[t]]


@pytest.mark.parametrize(("family", "kind"), TOKEN_CASES, ids=[f"{f}-{k}" for f, k in TOKEN_CASES])
def test_the_trained_tokens_are_trls_on_each_familys_own_tokenizer(family: str, kind: str) -> None:
    """The same comparison, token by token, with each family's tokenizer and its special tokens
    (tests/model_families.py): what trains here, as token ids, is TRL's masked run less the prompt cue's
    tokens, or for gpt-oss's earlier turns the documented difference."""
    from tests.model_families import family_tokenizer

    tokenizer = family_tokenizer(family)
    chat = chat_of(ROWS[kind])
    ours = [
        tokenizer(text, add_special_tokens=False)["input_ids"]
        for sequence in training_sequences(tokenizer, chat)
        for text, trained in sequence
        if trained
    ]
    out: Any = tokenizer.apply_chat_template(
        chat.messages,
        tools=chat.tools,
        chat_template=get_training_chat_template(tokenizer),
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    theirs: list[list[int]] = []
    previous = False
    for token, masked in zip(out["input_ids"], out["assistant_masks"], strict=True):
        if masked:
            if not previous:
                theirs.append([])
            theirs[-1].append(token)
        previous = bool(masked)
    assert len(ours) == len(theirs)
    turns = [i for i, w in enumerate(chat.weights) if w]
    for i, mine, trl_run in zip(turns, ours, theirs, strict=True):
        if family == "gpt-oss" and i != turns[-1] and "tool_calls" not in chat.messages[i]:
            assert tokenizer.decode(trl_run[-1:]) == "<|end|>" and tokenizer.decode(mine[-1:]) == "<|return|>"
            continue
        cue = trl_run[: len(trl_run) - len(mine)]
        assert trl_run[len(cue) :] == mine, (tokenizer.decode(mine), tokenizer.decode(trl_run))
        assert tokenizer.decode(cue) in {"", "\n", "<|start|>assistant"}
