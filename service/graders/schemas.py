"""Graders API objects in OpenAI's shapes (`fine_tuning.alpha.graders.validate` and `.run`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.graders.shapes import Grader


class GraderValidateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grader: Grader


class GraderValidateResponse(BaseModel):
    grader: dict[str, Any]


class GraderRunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grader: Grader
    # its length is capped by settings.grader_max_text_chars (service/graders/limits.py), which the
    # OpenAPI document states as maxLength (service/openapi.py)
    model_sample: str = Field(description="the completion to grade: {{sample.output_text}}")
    item: dict[str, Any] | None = Field(
        default=None, description="the dataset row the templates' {{item.<field>}} read"
    )


class RunErrors(BaseModel):
    """OpenAI's error flags; here only a Python grader's runtime error can be set (other faults are 400s)."""

    formula_parse_error: bool = False
    invalid_variable_error: bool = False
    model_grader_parse_error: bool = False
    model_grader_refusal_error: bool = False
    model_grader_server_error: bool = False
    model_grader_server_error_details: str | None = None
    other_error: bool = False
    python_grader_runtime_error: bool = False
    python_grader_runtime_error_details: str | None = None
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    sample_parse_error: bool = False
    truncated_observation_error: bool = False
    unresponsive_reward_error: bool = False


class RunMetadata(BaseModel):
    errors: RunErrors
    execution_time: float
    name: str
    sampled_model_name: str | None = None
    scores: dict[str, float]
    token_usage: int | None = None
    type: str


class GraderRunResponse(BaseModel):
    metadata: RunMetadata
    model_grader_token_usage_per_model: dict[str, Any] = {}
    reward: float
    sub_rewards: dict[str, float]
