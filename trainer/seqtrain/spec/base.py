"""Base class for every spec model: camelCase on the wire, snake_case in Python, no unknown keys."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic.alias_generators import to_camel

# Bounds shared by several models: far beyond any real job, small enough that nothing downstream overflows,
# allocates or loops for ever on them (`steps: 1e29`, `seqLen: 1e8`).
MAX_STEPS = 10**9
MAX_SEQ_LEN = 2**20
DAY = 24 * 3600


def _admits_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    return any(_admits_bool(a) for a in typing.get_args(annotation)) or annotation is Any


class SpecModel(BaseModel):
    """Kubernetes-style field names (``faultTolerance.maxRestarts``) with strict unknown-field rejection."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        use_enum_values=True,
        allow_inf_nan=False,  # `lr: .inf`, `backoffSeconds: .nan`: never a setting
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # Pydantic's lax mode reads `steps: true` as 1; YAML's true/false is never a count or a rate.
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and not _admits_bool(field.annotation):
                raise ValueError(f"expected {_kind(field.annotation)}, not a boolean")
        return value

    def to_dict(self) -> dict:
        """The wire form: camelCase keys, every default filled in (what the trainer reads)."""
        return self.model_dump(by_alias=True, mode="json")


def _kind(annotation: Any) -> str:
    args = typing.get_args(annotation) or (annotation,)
    if int in args:
        return "an integer"
    if float in args:
        return "a number"
    if str in args:
        return "a string (quote it)"
    literals = [v for arg in (annotation, *args) if typing.get_origin(arg) is typing.Literal
                for v in typing.get_args(arg)]
    if literals:
        return "one of " + ", ".join(map(str, literals))
    return "a value of another type"
