"""The spec reference (docs/spec-reference.md), generated from the models so every field is documented.

`python -m seqtrain.spec.reference > docs/spec-reference.md` (also `make crd`); a test keeps the file equal.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from seqtrain.spec.job import JobSpec


def _type_name(ann: Any) -> str:
    origin = get_origin(ann)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in get_args(ann))
    if origin in (typing.Union, types.UnionType):
        parts = [a for a in get_args(ann) if a is not type(None)]
        return " \\| ".join(_type_name(a) for a in parts) + (" \\| null" if len(parts) < len(get_args(ann)) else "")
    if origin in (list, tuple, dict):
        inner = ", ".join(_type_name(a) for a in get_args(ann) if a is not Ellipsis)
        return f"{origin.__name__}[{inner}]"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "object"
    return getattr(ann, "__name__", str(ann))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return "(object)"
        return f"`{value}`" if value not in ({}, []) else "empty"
    if field.default is PydanticUndefined:
        return "required"
    if field.default is None:
        return "unset"
    value = field.default
    if isinstance(value, bool):
        value = str(value).lower()
    return f"`{value}`"


def _submodel(ann: Any) -> type[BaseModel] | None:
    for cand in (ann, *get_args(ann)):
        if isinstance(cand, type) and issubclass(cand, BaseModel):
            return cand
        for inner in get_args(cand):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}.{field.alias or name}"
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{path}` | {_type_name(field.annotation)} | {_default(field)} | {desc} |")
        sub = _submodel(field.annotation)
        if sub is not None:
            rows += _rows(sub, path + ("[]" if get_origin(field.annotation) is list else ""))
    return rows


def markdown() -> str:
    lines = [
        "# SeqTrainJob spec reference",
        "",
        "GENERATED from `seqtrain.spec` by `python -m seqtrain.spec.reference` (`make crd`); do not edit by hand.",
        "Field names are as written in YAML. Cross-field rules (batch divisibility, parallel degrees, sequence",
        "length vs model) are described in the user guide and reported by `seqtrain validate`.",
        "",
        "| field | type | default | description |",
        "|---|---|---|---|",
        *_rows(JobSpec, "spec"),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
