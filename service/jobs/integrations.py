"""A job's experiment trackers, the spec's `integrations`: OpenAI's shape, plus a tunehouse extension.

    [{"type": "wandb", "wandb": {"project": "p", "name": null, "entity": null, "tags": ["a"]}},
     {"type": "tensorboard"}]

`wandb` is OpenAI's: the worker logs the job's config and every metric row to a Weights & Biases run
(worker/trackers.py). `tensorboard` is ours: the job's metrics as TensorBoard event files, a result file
of the succeeded job. One integration of each type at most. Validated here, stored as given, run by the
worker; a worker without the tracker's package fails the job with `integration_unavailable`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

INTEGRATION_TYPES = ("wandb", "tensorboard")
# W&B refuses tags longer than 64 characters; names and projects beyond 128 are refused by its UI
_Tag = Annotated[str, Field(min_length=1, max_length=64)]
_Name = Annotated[str, Field(min_length=1, max_length=128)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class WandbSettings(_Strict):
    project: _Name
    name: _Name | None = None  # the run's display name; None: the job id (as OpenAI)
    entity: _Name | None = None  # team or user; None: the default entity of the worker's W&B key
    tags: Annotated[list[_Tag], Field(max_length=64)] | None = None


class Integration(_Strict):
    # not a pydantic discriminated union: its errors name the tag ("integrations[0].wandb.wandb.project")
    type: Literal["wandb", "tensorboard"]
    wandb: WandbSettings | None = None

    @model_validator(mode="after")
    def _settings_match_the_type(self) -> Integration:
        if self.type == "wandb" and self.wandb is None:
            raise ValueError('a "wandb" integration needs its "wandb" settings (at least "project")')
        if self.type != "wandb" and self.wandb is not None:
            raise ValueError(f'"wandb" settings given for a "{self.type}" integration')
        return self


Integrations = Annotated[list[Integration], Field(max_length=len(INTEGRATION_TYPES))]


def duplicate_type(integrations: list[Integration]) -> int | None:
    """The index of the first integration whose type came earlier in the list, or None."""
    seen: set[str] = set()
    for i, integration in enumerate(integrations):
        if integration.type in seen:
            return i
        seen.add(integration.type)
    return None


def stored_integrations(integrations: list[Integration] | None) -> list[dict[str, object]] | None:
    if not integrations:
        return None
    return [i.model_dump(mode="json", exclude_none=True) for i in integrations]
