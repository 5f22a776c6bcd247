"""Bounds on a decoded SeqTrainJob document as a whole: size, nesting depth, and values no Kubernetes object can
hold. Checked first, iteratively (no recursion, stopping at the first bound passed), so nothing after it (pydantic,
the cross-field checks, deep copies, the manifest builders, JSON encoding) meets a document it cannot handle:
a 5000-deep document would raise RecursionError there, a 1.5 MB one would be kept in memory per job.

The limits are far beyond any real job (the deepest field of a spec, an ephemeral volume's
volumeClaimTemplate...matchExpressions[].values[], is 13 levels below the document) and documented in
docs/user-guide.md ("Security: what is trusted", Spec).
"""

from __future__ import annotations

import math
import re
from typing import Any

from seqtrain.spec.problems import Problem

MAX_SPEC_BYTES = 256 * 1024  # the spec as JSON, estimated from its keys and values (strings counted in UTF-8)
MAX_DEPTH = 32  # objects and lists inside one another, counted from the document
MAX_NODES = 100_000  # values in the document (load.py counts YAML nodes with aliases expanded against the same number)
INT64 = 2**63  # Kubernetes stores integers as int64; JSON numbers beyond that lose precision or are refused


def _scalar_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass")) + 2
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return value.bit_length() // 3 + 2  # digits, without str() (Python refuses str() of > 4300 digits)
    return 24


_QUOTED = re.compile(rb'"(?:[^"\\]|\\.)*"' + rb"|'(?:[^']|'')*'")
_BRACKETS = re.compile(rb"[\[\]{}]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def bracket_depth(raw: bytes, limit: int) -> int:
    """How deep `[` and `{` nest in JSON or flow-style YAML text, without parsing it (quoted strings skipped);
    counting stops past `limit`. Parsers recurse per level (PyYAML takes seconds on 2000 levels before it raises
    RecursionError), so a text is refused by this count first."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(_QUOTED.sub(b'""', raw)):
        if m.group() in (b"[", b"{"):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        else:
            depth = max(0, depth - 1)
    return deepest


SHAPE = ("depth", "nodes", "size")  # kinds after which nothing else may look at the document


def document_problems(doc: Any, root: str = "") -> list[tuple[str, Problem]]:
    """(kind, problem) of `doc` as a whole, at most one per kind: "depth" (deeper than MAX_DEPTH), "nodes" (more
    than MAX_NODES values), "size" (over MAX_SPEC_BYTES), then values no Kubernetes object holds: "int" (outside
    int64), "float" (not finite), "key" (not a string), "text" (a lone surrogate), "type" (a YAML-only type).
    `root`: the path `doc` is at. Stops at the first size or depth bound passed."""
    out: list[tuple[str, Problem]] = []
    seen: set[str] = set()

    def add(kind: str, path: str, message: str) -> None:
        if kind not in seen:
            seen.add(kind)
            shown = path if len(path) <= 160 else path[:120] + f"... ({len(path)} characters)"
            out.append((kind, Problem(shown or "<document>", message)))

    size = nodes = 0
    stack: list[tuple[Any, str, int]] = [(doc, root, 0)]
    while stack:
        value, path, depth = stack.pop()
        nodes += 1
        if depth > MAX_DEPTH:
            add("depth", path, f"nested more than {MAX_DEPTH} levels deep; no SeqTrainJob field is: flatten it")
            break
        if nodes > MAX_NODES:
            add("nodes", path or "<document>", f"more than {MAX_NODES} values in one document; a SeqTrainJob "
                                               "has hundreds")
            break
        if isinstance(value, dict):
            size += 2
            for k, v in value.items():
                if not isinstance(k, str):
                    add("key", path, f"key {str(k)[:40]!r} is a {type(k).__name__}; keys are strings (quote it)")
                    k = str(k)[:40]
                elif _SURROGATE.search(k):
                    add("text", path, "a key holds a lone UTF-16 surrogate (not text): remove it")
                size += _scalar_bytes(k) + 1
                stack.append((v, f"{path}.{k}" if path else k, depth + 1))
        elif isinstance(value, list | tuple):
            size += 2
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
        else:
            size += _scalar_bytes(value) + 1
            if isinstance(value, int) and not isinstance(value, bool) and not -INT64 <= value < INT64:
                add("int", path, f"an integer of {value.bit_length() // 3 + 1} digits; Kubernetes stores at most "
                                 "64-bit integers")
            elif isinstance(value, str) and _SURROGATE.search(value):
                add("text", path, "holds a lone UTF-16 surrogate (not text, no UTF-8 for it): remove it")
            elif isinstance(value, float) and not math.isfinite(value):
                add("float", path, f"{value} is not a number a Kubernetes object can hold; give a finite number")
            elif not isinstance(value, str | int | float | bool) and value is not None:
                add("type", path, f"a {type(value).__name__} value (a YAML tag such as !!binary, !!timestamp or "
                                  "!!set); give a string, number, boolean, list or object")
        if size > MAX_SPEC_BYTES:
            add("size", root or "<document>", f"about {size // 1024} KiB or more as JSON; a SeqTrainJob may be at "
                                              f"most {MAX_SPEC_BYTES // 1024} KiB (move data into a ConfigMap, a "
                                              "Secret or a volume)")
            break
    return out
