"""Merging `spec.podTemplate` over a generated trainer pod. Pure: takes a pod dict, returns a new one.

Precedence (the spec module `seqtrain.spec.template` refuses overrides of the operator's fields up front; the merge
below still lets the operator win wherever both set the same key, so a spec that skipped validation cannot break
rendezvous either):
- labels / annotations: the override's are added, the operator's win on a clash;
- trainer env: an override replaces only env vars the operator defaults (HOME, PYTHONUNBUFFERED, caches); rank and
  rendezvous variables stay the operator's; envFrom is added (Kubernetes lets `env` win over `envFrom`, so a secret
  cannot shadow MASTER_ADDR either);
- volumes, volumeMounts, init containers and sidecars are appended after the operator's; sidecars run as native
  sidecars (init containers with `restartPolicy: Always`, after the user's init containers): the kubelet stops them
  once the trainer exits, so a log shipper cannot keep a finished pod Running (Kubernetes >= 1.29);
- extended resources go into requests and limits (equal, as Kubernetes requires for extended resources);
- capabilities are added after the operator's `drop: [ALL]`;
- nodeAffinity is ANDed with the operator's placement (each required term of the override is combined with the
  operator's pin); preferred terms, podAffinity and podAntiAffinity are added.
"""

from __future__ import annotations

import copy
from typing import Any

from seqtrain.spec.template import PodTemplate, owned_env


def _merge_env(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = list(ours)
    index = {e["name"]: i for i, e in enumerate(out)}
    for e in theirs:
        name = e.get("name", "")
        if owned_env(name):
            continue
        if name in index:
            out[index[name]] = copy.deepcopy(e)  # a default the operator only suggests (HOME, caches ...)
        else:
            index[name] = len(out)
            out.append(copy.deepcopy(e))
    return out


def _and_terms(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Node selector terms are ORed by Kubernetes; to require both sets, combine every pair (a AND b)."""
    if not ours:
        return copy.deepcopy(theirs)
    if not theirs:
        return ours
    out = []
    for a in ours:
        for b in theirs:
            term: dict[str, Any] = {}
            for key in ("matchExpressions", "matchFields"):
                items = [*(a.get(key) or []), *copy.deepcopy(b.get(key) or [])]
                if items:
                    term[key] = items
            out.append(term)
    return out


def _merge_affinity(ours: dict[str, Any] | None, theirs: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(ours) if ours else {}
    node = theirs.get("nodeAffinity") or {}
    if node:
        na = out.setdefault("nodeAffinity", {})
        req_key = "requiredDuringSchedulingIgnoredDuringExecution"
        pref_key = "preferredDuringSchedulingIgnoredDuringExecution"
        if node.get(req_key):
            terms = _and_terms((na.get(req_key) or {}).get("nodeSelectorTerms") or [],
                               node[req_key].get("nodeSelectorTerms") or [])
            na[req_key] = {"nodeSelectorTerms": terms}
        if node.get(pref_key):
            na[pref_key] = [*(na.get(pref_key) or []), *copy.deepcopy(node[pref_key])]
    for kind in ("podAffinity", "podAntiAffinity"):
        if theirs.get(kind):
            out[kind] = copy.deepcopy(theirs[kind])
    return out


def _merge_trainer(container: dict[str, Any], override: dict[str, Any], extended: dict[str, str]) -> None:
    container["env"] = _merge_env(container.get("env") or [], override.get("env") or [])
    if override.get("envFrom"):
        container["envFrom"] = [*(container.get("envFrom") or []), *copy.deepcopy(override["envFrom"])]
    if override.get("volumeMounts"):
        container["volumeMounts"] = [*container["volumeMounts"], *copy.deepcopy(override["volumeMounts"])]
    for name, qty in extended.items():
        if name not in container["resources"]["requests"]:
            container["resources"]["requests"][name] = qty
            container["resources"]["limits"][name] = qty
    add = ((override.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
    if add:
        caps = container["securityContext"].setdefault("capabilities", {})
        caps["add"] = sorted({*caps.get("add", []), *add})


def apply_pod_template(pod: dict[str, Any], template: PodTemplate, trainer_name: str) -> dict[str, Any]:
    """`pod` with `template` merged over it (a new dict; `pod` is not changed)."""
    out = copy.deepcopy(pod)
    meta, spec = out["metadata"], out["spec"]
    if template.metadata.labels:
        meta["labels"] = {**template.metadata.labels, **meta["labels"]}
    if template.metadata.annotations:
        meta["annotations"] = {**template.metadata.annotations, **(meta.get("annotations") or {})}
    t = template.spec
    if t.service_account_name:
        spec["serviceAccountName"] = t.service_account_name
    if t.automount_service_account_token is not None:
        spec["automountServiceAccountToken"] = t.automount_service_account_token
    trainer = next(c for c in spec["containers"] if c["name"] == trainer_name)
    _merge_trainer(trainer, template.trainer(), template.extended_resources())
    sidecars = [{**copy.deepcopy(c), "restartPolicy": "Always"} for c in template.sidecars()]
    if t.init_containers or sidecars:
        spec["initContainers"] = [*(spec.get("initContainers") or []), *copy.deepcopy(t.init_containers), *sidecars]
    if t.volumes:
        spec["volumes"] = [*spec["volumes"], *copy.deepcopy(t.volumes)]
    if t.affinity:
        spec["affinity"] = _merge_affinity(spec.get("affinity"), t.affinity)
    return out
