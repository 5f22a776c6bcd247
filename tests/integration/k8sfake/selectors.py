"""Label and field selectors as the API server parses them (labels: =, ==, !=, in, notin, exists, !exists)."""

from __future__ import annotations

import re
from typing import Any

from .errors import bad_request

_SET = re.compile(r"^\s*(!?)\s*([A-Za-z0-9_./-]+)\s*(?:(in|notin)\s*\(([^)]*)\))?\s*$")
_EQ = re.compile(r"^\s*([A-Za-z0-9_./-]+)\s*(==|=|!=)\s*([A-Za-z0-9_.-]*)\s*$")


def _split(selector: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    parts, depth, cur = [], 0, ""
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p for p in parts if p.strip()]


def match_labels(selector: str, obj: dict[str, Any]) -> bool:
    if not selector:
        return True
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in _split(selector):
        if m := _EQ.match(term):
            key, op, value = m.groups()
            ok = labels.get(key) == value
            if (op == "!=" and ok) or (op != "!=" and not ok):
                return False
            continue
        m = _SET.match(term)
        if not m:
            raise bad_request(f"unable to parse requirement: {term!r}")
        neg, key, op, values = m.groups()
        if op:
            allowed = {v.strip() for v in values.split(",") if v.strip()}
            inside = key in labels and labels[key] in allowed
            if (op == "in" and not inside) or (op == "notin" and inside):
                return False
        elif bool(neg) == (key in labels):
            return False
    return True


def _field(obj: dict[str, Any], path: str) -> str:
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return "" if node is None else str(node)


SUPPORTED_FIELDS = {"metadata.name", "metadata.namespace", "spec.nodeName", "status.phase", "involvedObject.name",
                    "involvedObject.uid", "reason", "type"}


def match_fields(selector: str, obj: dict[str, Any]) -> bool:
    if not selector:
        return True
    for term in _split(selector):
        m = _EQ.match(term)
        if not m:
            raise bad_request(f"invalid field selector: {term!r}")
        key, op, value = m.groups()
        if key not in SUPPORTED_FIELDS:
            raise bad_request(f'field label not supported: "{key}"')
        ok = _field(obj, key) == value
        if (op == "!=" and ok) or (op != "!=" and not ok):
            return False
    return True
