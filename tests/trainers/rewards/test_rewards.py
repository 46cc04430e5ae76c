"""Graders: each type, the multi formula, the sandboxed python grader, spec validation, doctests."""

from __future__ import annotations

import doctest
import inspect
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import trainers.rewards.graders
from service.config import Settings
from trainers.data.preference import encode_prompt_completion
from trainers.rewards.graders import (
    GraderError,
    MultiGrader,
    PythonGrader,
    ScoreModel,
    StringCheck,
    TextSimilarity,
    build_grader,
    reward_name,
    sentence_bleu,
    validate_grader,
)

OUT = "{{sample.output_text}}"
PY = {"type": "python", "name": "py"}


def test_doctests_pass() -> None:
    result = doctest.testmod(trainers.rewards.graders, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 10


@pytest.mark.parametrize(
    ("operation", "expected"),
    [("eq", [1.0, 0.0, 0.0]), ("ne", [0.0, 1.0, 1.0]), ("like", [1.0, 1.0, 0.0]), ("ilike", [1.0, 1.0, 1.0])],
)
def test_string_check(operation: str, expected: list[float]) -> None:
    grader = build_grader(
        {
            "type": "string_check",
            "name": "s",
            "operation": operation,
            "input": OUT,
            "reference": "{{item.answer}}",
        }
    )
    completions = ["Lima", "It is Lima.", "LIMA"]
    assert grader(["q"] * 3, completions, answer=["Lima"] * 3) == expected


def test_string_check_reads_nested_fields_and_literals() -> None:
    nested = build_grader(
        {
            "type": "string_check",
            "name": "n",
            "operation": "eq",
            "input": OUT,
            "reference": "{{item.meta.city}}",
        }
    )
    assert nested(["q"], ["Lima"], meta=[{"city": "Lima"}]) == [1.0]
    with pytest.raises(GraderError, match=r"no field item.meta.city"):
        nested(["q"], ["Lima"], meta=[{}])


def test_text_similarity() -> None:
    fuzzy = build_grader(
        {
            "type": "text_similarity",
            "name": "f",
            "input": OUT,
            "reference": "Lima",
            "evaluation_metric": "fuzzy_match",
        }
    )
    assert fuzzy(["q", "q"], ["Lima", "Lime"]) == [1.0, 0.75]
    bleu = build_grader(
        {
            "type": "text_similarity",
            "name": "b",
            "input": OUT,
            "reference": "{{item.ref}}",
            "evaluation_metric": "bleu",
        }
    )
    ref = "the capital of peru is lima"
    scores = bleu(["q"] * 3, [ref, "the capital is lima", "bananas"], ref=[ref] * 3)
    assert scores[0] == 1.0 and 0.0 == scores[2] < scores[1] < 1.0  # no unigram match: 0
    # Hand computation: p1 = 4/4, p2 = (2+1)/(3+1), p3 = 1/3, p4 = 1/2; BP = exp(1 - 6/4).
    expected = (1 * 0.75 * (1 / 3) * 0.5) ** 0.25 * math.exp(-0.5)
    assert sentence_bleu("the capital is lima", ref) == pytest.approx(expected, abs=1e-9)


def test_template_errors_name_the_variable_and_the_field() -> None:
    cases = [
        ("{{sample.text}}", "x", "unknown template variable sample.text", "grader.input"),
        (OUT, "{{item.missing}}", "the row has no field item.missing", "grader.reference"),
        (OUT, "{{item.meta.lang}}", "the row has no field item.meta.lang", "grader.reference"),
    ]
    for input_, reference, message, param in cases:
        with pytest.raises(GraderError) as info:
            StringCheck("c", "eq", input_, reference)(["q"], ["a"], meta=[{"kind": "x"}])
        assert (str(info.value), info.value.param) == (message, param)


def test_templates_read_the_item_and_the_sample_on_either_side() -> None:
    check = StringCheck("c", "eq", "{{item.answer}}", OUT)
    assert check(["q", "q"], ["Lima", "Quito"], answer=["Lima", "Lima"]) == [1.0, 0.0]
    close = TextSimilarity("s", "fuzzy_match", "{{item.answer}}", OUT)
    assert close(["q", "q"], ["Lima", "Lime"], answer=["Lima", "Lima"]) == [1.0, 0.75]


def test_every_grader_is_named_for_its_metrics() -> None:
    specs = [
        {"type": "string_check", "name": "a", "operation": "eq", "input": OUT, "reference": "x"},
        {"type": "text_similarity", "name": "b", "input": OUT, "reference": "x", "evaluation_metric": "bleu"},
        {**PY, "name": "c", "source": "def grade(sample, item):\n    return 1.0"},
    ]
    assert [reward_name(build_grader(s, allow_python=True), 9) for s in specs] == ["a", "b", "c"]


def test_bleu_edges_written_out() -> None:
    assert (sentence_bleu("", ""), sentence_bleu("lima", ""), sentence_bleu("", "lima")) == (1.0, 0.0, 0.0)
    ref = "the capital of peru is lima"
    # longer than the reference (no brevity penalty): p1 = 6/7, p2 = (4+1)/(6+1), p3 = (3+1)/(5+1),
    # p4 = (2+1)/(4+1), and for 5-grams p5 = (1+1)/(3+1)
    hyp = "the capital of peru is not lima"
    p = [6 / 7, 5 / 7, 4 / 6, 3 / 5, 2 / 4]
    assert sentence_bleu(hyp, ref) == pytest.approx(math.prod(p[:4]) ** (1 / 4), abs=1e-12)
    assert sentence_bleu(hyp, ref, max_n=5) == pytest.approx(math.prod(p) ** (1 / 5), abs=1e-12)
    # shorter than n for n = 3, 4: those precisions are (0+1)/(0+1) = 1; BP = exp(1 - 4/2)
    assert sentence_bleu("lima is", "lima is the capital") == pytest.approx(math.exp(-1), abs=1e-12)


def test_reward_names_for_metrics() -> None:
    def my_reward(prompts: list[str], completions: list[str]) -> list[float]:
        return [0.0] * len(completions)

    class Unnamed:
        __name__ = 5  # not a string: not a name

    exact = build_grader(
        {"type": "string_check", "name": "exact", "operation": "eq", "input": OUT, "reference": "a"}
    )
    assert [reward_name(exact, 0), reward_name(my_reward, 1)] == ["exact", "my_reward"]
    assert [reward_name(lambda p, c: [], 2), reward_name(object(), 3), reward_name(Unnamed(), 4)] == [
        "reward_2",
        "reward_3",
        "reward_4",
    ]


def test_multi_passes_prompts_and_columns_and_names_its_errors() -> None:
    seen: list[tuple[list[str], dict[str, list[str]]]] = []

    def prompt_length(prompts: list[str], completions: list[str], **columns: list[str]) -> list[float]:
        seen.append((prompts, columns))
        return [float(len(p)) for p in prompts]

    close = TextSimilarity("close", "fuzzy_match", OUT, "{{item.ref}}")
    multi = MultiGrader("both", {"p": prompt_length, "c": close}, "p + c")
    assert multi(["ab", "abc"], ["Lima", "x"], ref=["Lima", "y"]) == [3.0, 3.0]  # 2 + 1 and 3 + 0
    assert seen == [(["ab", "abc"], {"ref": ["Lima", "y"]})]
    assert reward_name(multi, 0) == "both"
    with pytest.raises(GraderError, match="'q', which is not a grader name") as info:
        MultiGrader("both", {"p": prompt_length}, "q")
    assert info.value.param == "grader.calculate_output"


def test_multi_formula() -> None:
    spec = {
        "type": "multi",
        "graders": {
            "exact": {
                "type": "string_check",
                "name": "e",
                "operation": "eq",
                "input": OUT,
                "reference": "Lima",
            },
            "close": {
                "type": "text_similarity",
                "name": "c",
                "input": OUT,
                "reference": "Lima",
                "evaluation_metric": "fuzzy_match",
            },
        },
        "calculate_output": "0.5 * exact + 0.5 * close - min(abs(-0.1), 1) / 2",
    }
    grader = build_grader(spec)
    assert grader(["q", "q"], ["Lima", "Lime"]) == pytest.approx([0.95, 0.325])


@pytest.mark.parametrize(
    ("formula", "message"),
    [
        ("__import__('os')", "may only call min, max and abs"),
        ("a ** 2", r"may only use \+ - \* /"),
        ("a + b", "'b', which is not a grader name"),
        ("a.real", "may not contain Attribute"),
        ("'x'", "may only contain numbers"),
        ("a +", "not a valid formula"),
    ],
)
def test_multi_formula_is_restricted(formula: str, message: str) -> None:
    spec = {
        "type": "multi",
        "graders": {
            "a": {"type": "string_check", "name": "a", "operation": "eq", "input": OUT, "reference": "x"}
        },
        "calculate_output": formula,
    }
    with pytest.raises(GraderError, match=message) as info:
        validate_grader(spec)
    assert info.value.param == "grader.calculate_output"


SC = {"type": "string_check", "name": "x", "operation": "eq", "input": OUT, "reference": "a"}
TS = {"type": "text_similarity", "name": "x", "input": OUT, "reference": "a", "evaluation_metric": "bleu"}
SUB = {"type": "multi", "graders": {"a": SC}, "calculate_output": "a"}
KNOWN = "(known: sample.output_text, sample.output_tools)"


@pytest.mark.parametrize(
    ("spec", "message", "param"),
    [
        (["x"], "a grader must be an object", "g"),
        (
            {"type": "nope"},
            "type must be one of string_check, text_similarity, score_model, multi, python, not 'nope'",
            "g.type",
        ),
        ({**SC, "name": ""}, "name must be a non-empty string", "g.name"),
        ({**SC, "name": 3}, "name must be a non-empty string", "g.name"),
        ({**SC, "reference": None}, "reference must be a non-empty string", "g.reference"),
        ({**SC, "input": "{{sample.text}}"}, f"unknown template variable sample.text {KNOWN}", "g.input"),
        (
            {**TS, "reference": "{{sample.answer}}"},
            f"unknown template variable sample.answer {KNOWN}",
            "g.reference",
        ),
        (
            {**TS, "input": "{{ output }}"},
            "{{ output }} is not a template variable; use {{sample.output_text}}, {{sample.output_tools}} or "
            "{{item.<field>}}",
            "g.input",
        ),
        (
            {**SC, "operation": "equals"},
            "operation must be one of eq, ne, like, ilike, not 'equals'",
            "g.operation",
        ),
        (
            {**TS, "evaluation_metric": "rouge"},
            "evaluation_metric must be one of fuzzy_match, bleu, not 'rouge'",
            "g.evaluation_metric",
        ),
        ({"type": "score_model", "name": "x"}, "model must be a non-empty string", "g.model"),
        ({**PY, "source": "def grade(:"}, "source does not compile: invalid syntax (line 1)", "g.source"),
        (
            {**PY, "source": "def other(s, i): return 1"},
            "source must define a top-level function grade(sample, item)",
            "g.source",
        ),
        ({**PY, "source": ""}, "source must be a non-empty string", "g.source"),
        (
            {"type": "multi", "graders": {}, "calculate_output": "a"},
            "graders must be a non-empty object of named graders",
            "g.graders",
        ),
        (
            {"type": "multi", "graders": [SC], "calculate_output": "a"},
            "graders must be a non-empty object of named graders",
            "g.graders",
        ),
        (
            {"type": "multi", "graders": {"a b": SC}, "calculate_output": "a"},
            "grader name 'a b' must be an identifier",
            "g.graders",
        ),
        (
            {**SUB, "graders": {"a": {**SC, "operation": "equals"}}},
            "operation must be one of eq, ne, like, ilike, not 'equals'",
            "g.graders.a.operation",
        ),
        (
            {**SUB, "calculate_output": ""},
            "calculate_output must be a non-empty string",
            "g.calculate_output",
        ),
    ],
)
def test_validation_errors_word_for_word(spec: object, message: str, param: str) -> None:
    with pytest.raises(GraderError) as info:
        validate_grader(spec, param="g", allow_python=True)
    assert (str(info.value), info.value.param) == (message, param)


def test_python_graders_are_refused_where_disabled_even_inside_multi() -> None:
    spec = {
        **SUB,
        "graders": {"a": SC, "p": {**PY, "source": "def grade(s, i):\n    return 1"}},
        "calculate_output": "a + p",
    }
    with pytest.raises(GraderError) as info:
        build_grader(spec, param="g")
    assert (str(info.value), info.value.param) == (
        "python graders are disabled on this server; the operator must enable them",
        "g.graders.p.type",
    )


def test_a_built_grader_names_its_own_param_when_it_fails() -> None:
    """Errors raised while grading name the spec's field under the job's param."""
    param = "method.grpo.grader"
    spec = {**SUB, "graders": {"a": {**SC, "reference": "{{item.answer}}"}}}
    with pytest.raises(GraderError) as info:
        build_grader(spec, param=param)(["q"], ["x"])
    assert (str(info.value), info.value.param) == (
        "the row has no field item.answer",
        f"{param}.graders.a.reference",
    )
    for sub in ({**SC, "reference": "{{item.answer}}"}, {**TS, "reference": "{{item.answer}}"}):
        with pytest.raises(GraderError) as info:
            build_grader(sub, param=param)(["q"], ["x"])
        assert info.value.param == f"{param}.reference"
    with pytest.raises(GraderError) as info:
        build_grader({**SUB, "calculate_output": "b"}, param=param)
    assert info.value.param == f"{param}.calculate_output"
    looping = {**PY, "source": "def grade(s, i):\n    while True:\n        pass"}
    grader = build_grader(
        {**SUB, "graders": {"p": looping}, "calculate_output": "p"},
        allow_python=True,
        python_timeout=1,
        python_memory_mb=256,
        param=param,
    )
    with pytest.raises(GraderError, match="timed out after 1 s") as info:  # the limits reach a sub-grader
        grader(["q"], ["x"])
    assert info.value.param == f"{param}.graders.p"
    assert reward_name(build_grader(SUB), 0) == "multi"  # a multi grader needs no name: its type


def test_score_model(tiny_model_path: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    model.save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path / "rm")
    grader = build_grader({"type": "score_model", "name": "rm", "model": str(tmp_path / "rm")})
    prompts, completions = ["Hello", "Hello", "Capital?"], ["there", "friend of mine", "Lima"]
    scores = grader(prompts, completions)
    # Batched with padding == one at a time without padding, encoded as reward-model training encodes a
    # pair (BOS + prompt, completion + EOS; see test_reward_model for the match with training itself).
    tok = AutoTokenizer.from_pretrained(tmp_path / "rm")
    model.eval()
    for p, c, s in zip(prompts, completions, scores, strict=True):
        ids = torch.tensor([encode_prompt_completion(tok, p, c, max_length=1024)])
        with torch.no_grad():
            assert s == pytest.approx(model(input_ids=ids).logits[0, 0].item(), abs=1e-5)
    assert len(set(scores)) == 3 and reward_name(grader, 0) == "rm"
    with pytest.raises(GraderError, match="cannot load the reward model") as info:
        build_grader({"type": "score_model", "name": "rm", "model": str(tmp_path / "missing")})
    assert info.value.param == "grader.model"
    with pytest.raises(GraderError, match="cannot load the reward model") as info:
        ScoreModel("rm", str(tmp_path / "missing"))
    assert info.value.param == "grader.model"
    AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=2).save_pretrained(
        tmp_path / "two"
    )
    tok.save_pretrained(tmp_path / "two")
    with pytest.raises(GraderError, match="num_labels=1"):
        build_grader({"type": "score_model", "name": "rm", "model": str(tmp_path / "two")})


def test_python_grader_limits_default_to_the_servers() -> None:
    """build_grader's defaults (tests, scripts) are the server's settings defaults: one limit, not two."""
    defaults = inspect.signature(build_grader).parameters
    settings = Settings.model_fields
    assert defaults["python_timeout"].default == settings["python_grader_timeout_seconds"].default == 30.0
    assert defaults["python_memory_mb"].default == settings["python_grader_memory_mb"].default == 1024


def test_python_grader_runs_isolated_in_an_empty_folder_with_no_environment() -> None:
    source = (
        "import os, sys\n"
        "def grade(sample, item):\n"
        "    folder = os.path.basename(os.getcwd())\n"
        "    return (1 * (sys.flags.isolated == 1) + 2 * (os.listdir('.') == [])\n"
        "            + 4 * folder.startswith(item['folder'])\n"
        "            + 8 * (set(os.environ) <= {'LC_CTYPE', 'PWD'}))\n"
    )
    sandboxed = build_grader({**PY, "source": source}, allow_python=True)
    assert sandboxed(["q"], ["a"], folder=["tmp"]) == [15.0]  # python -I, in the sandbox's own /tmp
    unsafe = build_grader({**PY, "source": source}, allow_python=True, python_sandbox=False)
    assert unsafe(["q"], ["a"], folder=["grader-"]) == [15.0]  # the unsafe flag: a fresh host temp folder


def test_python_grader_runs_when_allowed() -> None:
    source = (
        "def grade(sample, item):\n    print('noise')\n    return sample['output_text'] == item['answer']"
    )
    grader = build_grader({**PY, "source": source}, allow_python=True)
    assert grader(["q", "q"], ["Lima", "Quito"], answer=["Lima", "Lima"]) == [1.0, 0.0]


def test_python_grader_is_refused_unless_allowed() -> None:
    with pytest.raises(GraderError, match="operator must enable them"):
        build_grader({**PY, "source": "def grade(sample, item):\n    return 1.0"})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("    while True:\n        pass", r"timed out after 2 s"),
        ("    x = bytearray(2 * 1024**3)\n    return 1.0", r"ran out of memory \(limit 256 MiB\)"),
        ("    raise KeyError('answer')", r"failed: KeyError: 'answer'"),
        ("    return 'high'", r"returned 'high' for sample 0; expected a finite number"),
        ("    import os\n    os._exit(3)", r"crashed"),
    ],
    ids=["timeout", "memory", "exception", "non-numeric", "crash"],
)
def test_python_grader_failures_raise_grader_error(body: str, message: str) -> None:
    grader = build_grader(
        {**PY, "source": f"def grade(sample, item):\n{body}"},
        allow_python=True,
        python_timeout=2,
        python_memory_mb=256,
    )
    with pytest.raises(GraderError, match=message) as info:
        grader(["q"], ["a"])
    assert info.value.param == "grader" and str(info.value).startswith("python grader 'py' ")


def test_a_crashed_python_grader_reports_its_last_words() -> None:
    body = (
        "    import os, sys\n"
        "    sys.stderr.write('first\\nsecond\\nlast words\\n')\n"
        "    sys.stderr.flush()\n"
        "    os._exit(3)"
    )
    grader = build_grader({**PY, "source": f"def grade(sample, item):\n{body}"}, allow_python=True)
    with pytest.raises(GraderError) as info:
        grader(["q"], ["a"])
    assert str(info.value) == "python grader 'py' crashed: last words"


def test_the_edges_of_grading() -> None:
    # a number from the row is rendered as JSON text
    assert StringCheck("n", "eq", "{{item.n}}", "3")(["q"], ["x"], n=[3]) == [1.0]

    # a sub-grader that cannot judge a sample leaves the combination unjudged
    def half(prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        return [1.0, None]

    multi = MultiGrader("m", {"h": half}, "h")
    assert multi(["q", "q"], ["a", "b"]) == [1.0, None]
    # a python sub-grader is refused by validation where python is disabled; validation allows it by default
    spec = {
        **SUB,
        "graders": {"p": {**PY, "source": "def grade(s, i):\n    return 1"}},
        "calculate_output": "p",
    }
    with pytest.raises(GraderError, match="python graders are disabled") as info:
        validate_grader(spec, allow_python=False)
    assert info.value.param == "grader.graders.p.type"
    validate_grader(spec)
    # graders built directly name the default param
    with pytest.raises(GraderError) as info:
        TextSimilarity("t", "bleu", OUT, "{{item.ref}}")(["q"], ["x"])
    assert info.value.param == "grader.reference"
    with pytest.raises(GraderError) as info:
        PythonGrader("p", "def grade(s, i):\n    raise ValueError", timeout=30, memory_mb=256)(["q"], ["x"])
    assert info.value.param == "grader"


def test_the_memory_limit_reaches_a_python_sub_grader() -> None:
    hungry = {**PY, "source": "def grade(s, i):\n    x = bytearray(2 * 1024**3)\n    return 1.0"}
    grader = build_grader(
        {**SUB, "graders": {"p": hungry}, "calculate_output": "p"}, allow_python=True, python_memory_mb=256
    )
    with pytest.raises(GraderError, match=r"ran out of memory \(limit 256 MiB\)"):
        grader(["q"], ["x"])
