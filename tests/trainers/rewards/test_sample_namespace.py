"""Graders read a sampled completion as OpenAI's graders read a sample (trainers/rewards/samples.py):
``{{sample.output_text}}`` its content without reasoning or tool-call markup, ``{{sample.output_tools}}``
its calls as a chat completion's ``tool_calls`` — in string checks, similarity, multi graders and the
python grader's ``sample`` — from completions read with the model's chat format."""

from __future__ import annotations

import doctest
from typing import Any

import pytest

import trainers.rewards.samples
from trainers.chat.formats import HARMONY, HERMES, PLAIN
from trainers.rewards.graders import GraderError, build_grader, validate_grader
from trainers.rewards.samples import Completion

CALLED = Completion.read(
    '<think>\nParis, so the tool.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Paris"}}\n</tool_call>',
    HERMES,
)
ANSWERED = Completion.read(
    "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Lima", HARMONY
)
NAME = "{{sample.output_tools[0].function.name}}"


def check(input: str, reference: str, operation: str = "eq") -> Any:
    return build_grader(
        {"type": "string_check", "name": "g", "operation": operation, "input": input, "reference": reference}
    )


def test_doctests_pass() -> None:
    assert doctest.testmod(trainers.rewards.samples).failed == 0


def test_a_grader_checks_the_called_tool_s_name_and_arguments() -> None:
    completions = [CALLED, ANSWERED, Completion("no call", PLAIN.parse("no call"))]
    assert check(NAME, "get_weather")(["q"] * 3, completions) == [1.0, 0.0, 0.0]
    arguments = check("{{sample.output_tools[0].function.arguments}}", '{"city": "{{item.city}}"}')
    assert arguments(["q"] * 3, completions, city=["Paris"] * 3) == [1.0, 0.0, 0.0]
    # the whole list, as JSON: OpenAI's tool_calls shape
    tools = check("{{sample.output_tools}}", '"type": "function"', operation="like")
    assert tools(["q"], [CALLED]) == [1.0]


def test_output_text_is_the_content_without_reasoning_or_calls() -> None:
    text = check("{{sample.output_text}}", "{{item.answer}}")
    assert text(["q", "q"], [CALLED, ANSWERED], answer=["Checking.", "Lima"]) == [1.0, 1.0]
    # a plain string (a reward function called by hand) is all content
    assert text(["q"], ["Lima"], answer=["Lima"]) == [1.0]
    # a multi grader: the name and the text together
    multi = build_grader(
        {
            "type": "multi",
            "graders": {
                "called": {
                    "type": "string_check",
                    "name": "called",
                    "operation": "eq",
                    "input": NAME,
                    "reference": "get_weather",
                },
                "said": {
                    "type": "string_check",
                    "name": "said",
                    "operation": "like",
                    "input": "{{sample.output_text}}",
                    "reference": "Check",
                },
            },
            "calculate_output": "0.5 * called + 0.5 * said",
        }
    )
    assert multi(["q", "q"], [CALLED, ANSWERED]) == [1.0, 0.0]


def test_the_python_grader_gets_the_sample_as_openai_gives_it() -> None:
    source = (
        "def grade(sample, item):\n"
        "    calls = sample['output_tools']\n"
        "    return float(bool(calls) and calls[0]['function']['name'] == 'get_weather'"
        " and sample['output_text'] == 'Checking.')\n"
    )
    grader = build_grader({"type": "python", "name": "py", "source": source}, allow_python=True)
    assert grader(["q", "q"], [CALLED, ANSWERED]) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("{{sample.output_json}}", "unknown template variable sample.output_json (known: sample.output_text"),
        ("{{sample.choices[0]}}", "unknown template variable sample.choices[0]"),
        ("{{sample.output_tools[x]}}", "is not a template variable"),
    ],
)
def test_unknown_sample_variables_are_refused_before_anything_runs(template: str, says: str) -> None:
    with pytest.raises(GraderError) as caught:
        validate_grader(
            {"type": "string_check", "name": "g", "operation": "eq", "input": template, "reference": "x"}
        )
    assert says in str(caught.value) and caught.value.param == "grader.input"
