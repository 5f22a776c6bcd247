"""Turning any bad input into `FILE: spec.path: message` lines, never a traceback."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

# Characters that would break a problem over lines (str.splitlines splits on all of them) or hide text in a
# terminal; a key or value from the input may hold any of them.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def one_line(text: str) -> str:
    """`text` with control characters and line separators escaped (\\n, \\x1b ...)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


@dataclass(frozen=True)
class Problem:
    path: str  # dotted field path, e.g. "spec.training.steps"; "<yaml>" / "--set" for input that never parsed
    message: str

    def __post_init__(self) -> None:
        # one problem, one line, whatever the input's keys and values hold
        object.__setattr__(self, "path", one_line(str(self.path)))
        object.__setattr__(self, "message", one_line(str(self.message)))

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecError(Exception):
    """Raised with every problem found, so a user fixes a file in one pass."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


def loc_to_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _allowed_fields(model: Any, loc: tuple[Any, ...]) -> list[str]:
    """Names valid at the parent of an unknown key, to suggest the right spelling."""
    from pydantic import BaseModel

    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        fields = getattr(current, "model_fields", {})
        match = next((f for n, f in fields.items() if part in (n, f.alias)), None)
        if match is None:
            return []
        ann = match.annotation
        # unwrap Optional[X] / list[X]
        for arg in getattr(ann, "__args__", ()) or ():
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                ann = arg
                break
        current = ann
    fields = getattr(current, "model_fields", {})
    return [f.alias or n for n, f in fields.items()]


def from_validation_error(err: ValidationError, model: Any) -> list[Problem]:
    problems = []
    for e in err.errors():
        path = loc_to_path(e["loc"])
        if e["type"] == "extra_forbidden":
            allowed = _allowed_fields(model, e["loc"])
            close = difflib.get_close_matches(str(e["loc"][-1]), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            msg = f"unknown field; {hint}valid fields here: {', '.join(sorted(allowed))}"
        elif e["type"] == "missing":
            msg = "required field is missing"
        else:
            msg = e["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            if "input" in e and not isinstance(e["input"], dict | list):
                got = repr(e["input"]) if not isinstance(e["input"], int) or abs(e["input"]) < 10**40 else "a huge int"
                msg += f" (got {got if len(got) <= 80 else got[:60] + f'... ({len(got)} characters)'})"
        problems.append(Problem(path, msg))
    return problems
