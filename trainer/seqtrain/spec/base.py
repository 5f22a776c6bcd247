"""Base class for every spec model: camelCase on the wire, snake_case in Python, no unknown keys."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class SpecModel(BaseModel):
    """Kubernetes-style field names (``faultTolerance.maxRestarts``) with strict unknown-field rejection."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        use_enum_values=True,
    )

    def to_dict(self) -> dict:
        """The wire form: camelCase keys, every default filled in (what the trainer reads)."""
        return self.model_dump(by_alias=True, mode="json")
