"""Graders for RL jobs, in OpenAI's shape, validated at the API boundary (the worker turns them into
reward functions with trainers.rewards.graders.build_grader, which checks them again). The `multi` formula is
checked by `trainers.rewards.formula`, the stdlib-only checker the worker uses too (DESIGN.md lets the service
import it and `trainers.registry`, nothing else of trainers)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from trainers.rewards.formula import FormulaError, parse_formula

TEMPLATE_HELP = (
    "use {{sample.output_text}} for the completion's content, {{sample.output_tools}} for its tool calls "
    "(e.g. {{sample.output_tools[0].function.name}}) and {{item.<field>}} for a column of the row"
)


class _Grader(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(default="grader", min_length=1, max_length=64)


class StringCheckGrader(_Grader):
    type: Literal["string_check"]
    operation: Literal["eq", "ne", "like", "ilike"]
    input: str = Field(min_length=1, description=TEMPLATE_HELP)
    # non-empty, as trainers.rewards.graders.validate_grader requires: stated here so the schema says it too
    reference: str = Field(min_length=1, description=TEMPLATE_HELP)


class TextSimilarityGrader(_Grader):
    type: Literal["text_similarity"]
    evaluation_metric: Literal["fuzzy_match", "bleu"]
    input: str = Field(min_length=1, description=TEMPLATE_HELP)
    reference: str = Field(min_length=1, description=TEMPLATE_HELP)


class ScoreModelGrader(_Grader):
    """A reward model trained on this service (a `reward_model` job's `fine_tuned_model`)."""

    type: Literal["score_model"]
    model: str = Field(min_length=1)


class PythonGrader(_Grader):
    """Tenant code `def grade(sample, item) -> float`, run in a sandboxed process (operator opt-in)."""

    type: Literal["python"]
    source: str = Field(min_length=1, max_length=100_000)


# a sub-grader's name is a variable of the formula: an ASCII identifier (trainers.rewards.formula reads it)
SUB_GRADER_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class MultiGrader(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["multi"]
    name: str = Field(default="multi", min_length=1, max_length=64)
    graders: dict[
        str,
        Annotated[
            StringCheckGrader | TextSimilarityGrader | ScoreModelGrader | PythonGrader,
            Field(discriminator="type"),
        ],
    ] = Field(min_length=1, json_schema_extra={"propertyNames": {"pattern": SUB_GRADER_NAME}})
    calculate_output: str = Field(min_length=1, max_length=1000)

    @field_validator("graders")
    @classmethod
    def _names(cls, graders: dict[str, BaseModel]) -> dict[str, BaseModel]:
        for name in graders:
            if not re.fullmatch(SUB_GRADER_NAME, name):
                raise ValueError(f"grader name {name!r} must be an identifier: ASCII letters, digits and _")
        return graders

    @field_validator("calculate_output")
    @classmethod
    def _formula(cls, formula: str, info: ValidationInfo) -> str:
        # a field validator (graders are validated first, being declared first), so an error names
        # calculate_output itself
        try:
            parse_formula(formula, list(info.data.get("graders", {})))
        except FormulaError as exc:
            raise ValueError(str(exc)) from exc
        return formula


Grader = Annotated[
    StringCheckGrader | TextSimilarityGrader | ScoreModelGrader | PythonGrader | MultiGrader,
    Field(discriminator="type"),
]


def python_graders(grader: BaseModel) -> bool:
    if isinstance(grader, PythonGrader):
        return True
    return isinstance(grader, MultiGrader) and any(
        isinstance(g, PythonGrader) for g in grader.graders.values()
    )


def score_models(grader: BaseModel) -> list[str]:
    if isinstance(grader, ScoreModelGrader):
        return [grader.model]
    if isinstance(grader, MultiGrader):
        return [g.model for g in grader.graders.values() if isinstance(g, ScoreModelGrader)]
    return []
