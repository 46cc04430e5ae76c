"""Graders for RL jobs, in OpenAI's shape, validated at the API boundary (the worker turns them into
reward functions with trainers.rewards.build_grader, which checks them again)."""

from __future__ import annotations

import ast
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TEMPLATE_HELP = "use {{sample.output_text}} for the completion and {{item.<field>}} for a column of the row"


class _Grader(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(default="grader", min_length=1, max_length=64)


class StringCheckGrader(_Grader):
    type: Literal["string_check"]
    operation: Literal["eq", "ne", "like", "ilike"]
    input: str = Field(min_length=1, description=TEMPLATE_HELP)
    reference: str = Field(description=TEMPLATE_HELP)


class TextSimilarityGrader(_Grader):
    type: Literal["text_similarity"]
    evaluation_metric: Literal["fuzzy_match", "bleu"]
    input: str = Field(min_length=1, description=TEMPLATE_HELP)
    reference: str = Field(description=TEMPLATE_HELP)


class ScoreModelGrader(_Grader):
    """A reward model trained on this service (a `reward_model` job's `fine_tuned_model`)."""

    type: Literal["score_model"]
    model: str = Field(min_length=1)


class PythonGrader(_Grader):
    """Tenant code `def grade(sample, item) -> float`, run in a sandboxed process (operator opt-in)."""

    type: Literal["python"]
    source: str = Field(min_length=1, max_length=100_000)


_FORMULA_NODES = (
    ast.Expression,
    ast.BinOp,
    ast.UnaryOp,
    ast.Constant,
    ast.Name,
    ast.Load,
    ast.Call,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.USub,
    ast.UAdd,
)
_FORMULA_FUNCTIONS = ("min", "max", "abs")


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
    ] = Field(min_length=1)
    calculate_output: str = Field(min_length=1, max_length=1000)

    @model_validator(mode="after")
    def _formula(self) -> MultiGrader:
        try:
            tree = ast.parse(self.calculate_output, mode="eval")
        except SyntaxError as exc:
            raise ValueError(f"calculate_output is not a formula: {exc.msg}") from exc
        for node in ast.walk(tree):
            if not isinstance(node, _FORMULA_NODES):
                raise ValueError(
                    f"calculate_output may use numbers, + - * /, min, max, abs and grader names only; "
                    f"found {type(node).__name__}"
                )
            if isinstance(node, ast.Call) and not (
                isinstance(node.func, ast.Name) and node.func.id in _FORMULA_FUNCTIONS
            ):
                raise ValueError("calculate_output may call only min, max and abs")
            if (
                isinstance(node, ast.Name)
                and node.id not in self.graders
                and node.id not in _FORMULA_FUNCTIONS
            ):
                raise ValueError(f"calculate_output names '{node.id}', which is not one of the graders")
        return self


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
