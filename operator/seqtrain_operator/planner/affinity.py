"""Required node affinity (pure): does a node satisfy a pod's nodeSelectorTerms, as kube-scheduler's NodeAffinity
plugin decides it (core/v1 NodeSelector: the terms are ORed, the requirements of one term ANDed).

Why the planner needs it: `spec.podTemplate.spec.affinity.nodeAffinity` is ANDed with the operator's pin
(k8s/pods/template.py), so a pod pinned to a node that fails the user's terms stays Pending for ever; the planner
leaves such nodes out instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Terms = tuple[Any, ...]  # nodeSelectorTerms as written (dicts), frozen into a tuple for the Demand


def _requirement(req: Mapping[str, Any], value: str | None) -> bool:
    op, values = req.get("operator"), [str(v) for v in req.get("values") or []]
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and len(values) == 1:
        try:
            have, bound = int(value), int(values[0])
        except ValueError:
            return False
        return have > bound if op == "Gt" else have < bound
    return False


def term_matches(term: Mapping[str, Any], name: str, labels: Mapping[str, str]) -> bool:
    """One NodeSelectorTerm; an empty term matches no node (the API's rule)."""
    exprs, fields = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not exprs and not fields:
        return False
    return (all(_requirement(r, labels.get(str(r.get("key")))) for r in exprs)
            and all(_requirement(r, name if r.get("key") == "metadata.name" else None) for r in fields))


def matches(terms: Sequence[Mapping[str, Any]], name: str, labels: Mapping[str, str]) -> bool:
    """The node satisfies the required node affinity (no terms: no constraint)."""
    return not terms or any(term_matches(t, name, labels) for t in terms)


def required_terms(affinity: Mapping[str, Any] | None) -> Terms:
    """The requiredDuringSchedulingIgnoredDuringExecution nodeSelectorTerms of a core/v1 Affinity."""
    node = (affinity or {}).get("nodeAffinity") or {}
    return tuple((node.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or [])
