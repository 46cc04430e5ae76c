"""The job spec: one pydantic source of truth, used by the API to validate and by the worker to run.

A method object has OpenAI's shape, `{"type": T, T: {"hyperparameters": {...}}}`. Hyperparameters
accept OpenAI's names (`n_epochs`, `batch_size`, `learning_rate_multiplier`, `beta`, each a number or
"auto") plus ours; "auto" is resolved at creation (`resolve_hyperparameters`) and stored resolved.

Nothing about a method is declared here: the pydantic models are built from `trainers.registry` (names,
types, defaults, ranges, whether a grader is required), the torch-free table the trainers' configs check
against too, so the API and the trainers cannot disagree on a range. Field names are the trainers'
config field names (`lora` -> `use_lora` is declared there), so the worker maps them by name
(`worker/methods.py` owns that translation: spec -> trainer config).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from service.graders.shapes import Grader
from service.jobs.integrations import Integrations
from service.jobs.resources import Resources
from service.jobs.schemas import Metadata
from trainers.registry import AUTO, METHODS, Hyperparameter
from trainers.registry import Method as MethodDeclaration

Auto = Literal["auto"]
METHOD_TYPES: tuple[str, ...] = tuple(METHODS)


class _Strict(BaseModel):
    # strict: `true` is not an int and `1e30` is not a step count (lax mode takes both); floats still
    # accept integers
    model_config = ConfigDict(extra="forbid", strict=True)


class Hyperparameters(_Strict):
    """Base of every method's hyperparameter model; the fields come from `trainers.registry`."""


# "auto" that depends on the dataset; the other "auto"s resolve to the registry's `auto_value`
_DATA_RULES: dict[str, Callable[[int], int]] = {
    # batch: 1/8 of the data, between 1 and 8 — small sets still get several steps per epoch
    "batch_size": lambda n: max(1, min(8, n // 8)),
    # epochs: aim for ~256 example-passes on small sets, never fewer than 1 or more than 10
    "n_epochs": lambda n: max(1, min(10, math.ceil(256 / max(1, n)))),
}
_KINDS: dict[str, Any] = {"int": int, "float": float, "bool": bool, "str": str, "str_list": list[str]}


def _annotation(p: Hyperparameter) -> Any:
    if p.auto and p.name not in _DATA_RULES and p.auto_value is None:
        raise RuntimeError(f"hyperparameter {p.name!r} takes 'auto' but declares no auto_value")
    kind: Any = Literal[p.choices] if p.choices else _KINDS[p.kind]
    if p.kind in ("int", "float"):
        finite = False if p.kind == "float" else None  # no inf or nan in a float hyperparameter
        kind = Annotated[kind, Field(ge=p.ge, gt=p.gt, le=p.le, lt=p.lt, allow_inf_nan=finite)]
    if p.auto:
        kind = kind | Auto
    if p.nullable:
        kind = kind | None
    return kind


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _hyperparameter_model(m: MethodDeclaration) -> type[Hyperparameters]:
    fields: dict[str, Any] = {p.name: (_annotation(p), p.default) for p in m.hyperparameters}
    return create_model(f"{_camel(m.name)}Hyperparameters", __base__=Hyperparameters, **fields)


def _body_model(m: MethodDeclaration) -> type[BaseModel]:
    hp = _hyperparameter_model(m)
    fields: dict[str, Any] = {"hyperparameters": (hp, Field(default_factory=hp))}
    if m.grader:
        fields["grader"] = (Grader, ...)
    return create_model(f"{_camel(m.name)}Method", __base__=_Strict, **fields)


BODIES: dict[str, type[BaseModel]] = {name: _body_model(m) for name, m in METHODS.items()}


def _one_body_per_type(schema: dict[str, Any]) -> None:
    """The schema states `_one_body`: one variant per type, where `type` is that type, its own body may be
    given (must be, for a method with a grader) and every other method's is absent or null."""
    properties = schema.get("properties", {})
    if not all(name in properties for name in METHOD_TYPES):
        return  # MethodBase itself: no bodies to relate
    variants = []
    for name, declaration in METHODS.items():
        own = properties[name]["anyOf"][0] if declaration.grader else properties[name]
        others = {other: {"type": "null"} for other in METHOD_TYPES if other != name}
        variants.append(
            {
                "properties": {"type": {"const": name}, name: own, **others},
                "required": ["type", name] if declaration.grader else ["type"],
            }
        )
    schema["oneOf"] = variants


class MethodBase(_Strict):
    """`{"type": T, T: {...}}`; the concrete `Method` adds one optional body field per registry entry."""

    model_config = ConfigDict(json_schema_extra=_one_body_per_type)

    type: str

    @model_validator(mode="after")
    def _one_body(self) -> MethodBase:
        for other in METHOD_TYPES:
            if other != self.type and getattr(self, other) is not None:
                raise ValueError(f"method.{other} given but method.type is '{self.type}'")
        if getattr(self, self.type) is None:
            if self.declaration.grader:
                raise ValueError(f"method.{self.type} with a 'grader' is required for method '{self.type}'")
            setattr(self, self.type, BODIES[self.type]())
        return self

    @property
    def declaration(self) -> MethodDeclaration:
        return METHODS[self.type]

    @property
    def grader(self) -> BaseModel | None:
        return getattr(getattr(self, self.type), "grader", None)

    @property
    def hyperparameters(self) -> Hyperparameters:
        hp = getattr(getattr(self, self.type), "hyperparameters", None)
        if not isinstance(hp, Hyperparameters):
            raise ValueError(f"method '{self.type}' has no typed hyperparameters")
        return hp


if TYPE_CHECKING:
    Method = MethodBase
else:
    Method = create_model(
        "Method",
        __base__=MethodBase,
        type=(Literal[METHOD_TYPES], ...),
        **{name: (body | None, None) for name, body in BODIES.items()},
    )


class LegacyHyperparameters(_Strict):
    """OpenAI's deprecated top-level `hyperparameters` (supervised only)."""

    n_epochs: Annotated[int, Field(ge=1, le=100)] | Auto = "auto"
    batch_size: Annotated[int, Field(ge=1, le=1024)] | Auto = "auto"
    learning_rate_multiplier: Annotated[float, Field(gt=0, le=100)] | Auto = "auto"


class JobCreate(_Strict):
    model: str = Field(min_length=1, max_length=500)
    training_file: str = Field(min_length=1)
    validation_file: str | None = None
    hyperparameters: LegacyHyperparameters | None = None
    method: Method | None = None
    suffix: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    metadata: Metadata | None = None
    integrations: Integrations | None = None
    # extension: GPUs (ranks) per job, service/jobs/resources.py
    resources: Resources | None = None


def resolve_hyperparameters(method: MethodBase, *, n_examples: int) -> None:
    """Replace every "auto" in the method's hyperparameters with a number chosen from the dataset size
    (`_DATA_RULES`) or the registry's `auto_value`."""
    hp = method.hyperparameters
    for p in method.declaration.hyperparameters:
        if p.auto and getattr(hp, p.name) == AUTO:
            rule = _DATA_RULES.get(p.name)
            # a method's own lower bound wins over the data rule (KTO needs 2 examples per micro-batch)
            value = max(rule(n_examples), math.ceil(p.ge or 0)) if rule else p.auto_value
            setattr(hp, p.name, value)


def hyperparameter_problem(method: MethodBase) -> tuple[str, str] | None:
    """(param, message) of the first cross-field constraint the resolved hyperparameters break."""
    problem = method.declaration.check(resolved_values(method))
    if problem is None:
        return None
    name, message = problem
    return f"method.{method.type}.hyperparameters.{name}", message


def quantization_of(method: MethodBase) -> str | None:
    """The job's `quantization` ("nf4", "int8"), None for an unquantized base or a method without it."""
    quantization = getattr(
        getattr(getattr(method, method.type), "hyperparameters", None), "quantization", None
    )
    return quantization if isinstance(quantization, str) else None


def resources_problem(method: MethodBase, resources: Resources) -> tuple[str, str] | None:
    """(param, message) where the resolved hyperparameters do not fit the job's `resources`: a quantized
    base is not sharded (FSDP splits weights that bitsandbytes keeps packed with their block scales)."""
    quantization = quantization_of(method)
    if quantization is None or resources.strategy != "fsdp":
        return None
    param = f"method.{method.type}.hyperparameters.quantization"
    return param, f"quantization={quantization!r}: not with resources.strategy 'fsdp'; use 'ddp'"


def resolved_values(method: MethodBase) -> dict[str, Any]:
    """The hyperparameters by their API names, once "auto" is resolved (``resolve_hyperparameters``)."""
    values = method.hyperparameters.model_dump()
    if any(p.auto and values[p.name] == AUTO for p in method.declaration.hyperparameters):
        raise ValueError("hyperparameters must be resolved first")
    return values


def stored_method(method: MethodBase) -> dict[str, Any]:
    return method.model_dump(mode="json", exclude_none=True)


def load_method(data: dict[str, Any]) -> MethodBase:
    return Method.model_validate(data)
