"""CRD generation from the spec models: pydantic JSON Schema -> Kubernetes structural openAPIV3Schema.

`crds/seqtrainjob.yaml` and the Helm chart's copy are this module's output; a test keeps them byte-equal.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from seqtrain.spec.job import API_GROUP, API_VERSION, API_VERSION_NAME, KIND, PLURAL, SHORT_NAMES, JobSpec
from seqtrain.spec.status import JobStatus

# Keys of JSON Schema that Kubernetes' OpenAPI v3 subset understands (others are dropped).
_KEEP = {
    "type", "properties", "items", "additionalProperties", "description", "enum", "default", "format",
    "minimum", "maximum", "minItems", "maxItems", "minLength", "maxLength", "pattern", "nullable",
    "required", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
    "exclusiveMinimum", "exclusiveMaximum", "x-kubernetes-validations",
}

# ---- CEL rules: the API is safe without the webhook ---------------------------------------------------------------
# Fields a running gang depends on (its ConfigMap, pod shapes and checkpoints were made from them): changing one
# while a gang exists would make the next restart resume a checkpoint into a different world. (path, default)
IMMUTABLE_WHILE_RUNNING: tuple[tuple[str, object], ...] = (
    ("replicas", 1), ("image", None), ("resources.gpus", 0), ("optimization.tensorParallel", 1),
    ("optimization.pipelineParallel", 1), ("model.arch", "gpt"),
)
LIVE_PHASES = ("Scheduling", "Running", "Restarting")


def _value(root: str, path: str, default: object) -> str:
    """CEL for spec.<path> of `root` (self / oldSelf), the model's default where the field or a parent is absent
    (the apiserver defaults a scalar only inside a parent object that exists)."""
    parts = path.split(".")
    expr = f"{root}.spec." + ".".join(parts)
    if default is None:
        return expr
    guards = " && ".join(f"has({root}.spec.{'.'.join(parts[:i + 1])})" for i in range(len(parts)))
    lit = f"'{default}'" if isinstance(default, str) else str(default)
    return f"(({guards}) ? {expr} : {lit})"


def immutable_rule() -> dict[str, str]:
    same = " && ".join(f"{_value('self', p, d)} == {_value('oldSelf', p, d)}" for p, d in IMMUTABLE_WHILE_RUNNING)
    live = ", ".join(f"'{p}'" for p in LIVE_PHASES)
    fields = ", ".join(f"spec.{p}" for p, _ in IMMUTABLE_WHILE_RUNNING)
    return {
        "rule": f"!has(oldSelf.status) || !has(oldSelf.status.phase) || !(oldSelf.status.phase in [{live}]) || "
                f"({same})",
        "message": f"{fields} cannot change while a gang exists (phase {', '.join(LIVE_PHASES)}): set spec.suspend "
                   "to true, wait for phase Suspended, change them, then set it back to false",
        "reason": "FieldValueForbidden",
    }


def _procs(root: str) -> str:
    return (f"(has({root}.resources) && has({root}.resources.processesPerReplica) ? "
            f"{root}.resources.processesPerReplica : (has({root}.resources) && {root}.resources.gpus > 0 ? "
            f"{root}.resources.gpus : 1))")


def _opt(root: str, field: str) -> str:
    return f"(has({root}.optimization) && has({root}.optimization.{field}) ? {root}.optimization.{field} : 1)"


# The webhook's cross-field checks (seqtrain.spec.checks) that CEL can express over the stored object, by the
# schema path of the object they are attached to ("" = spec).
CROSS_FIELD_RULES: dict[str, list[dict[str, str]]] = {
    "": [{
        "rule": f"({_opt('self', 'tensorParallel')} * {_opt('self', 'pipelineParallel')}) > 0 && "
                f"(self.replicas * {_procs('self')}) % ({_opt('self', 'tensorParallel')} * "
                f"{_opt('self', 'pipelineParallel')}) == 0",
        "message": "optimization.tensorParallel x pipelineParallel must divide the world size (replicas x "
                   "processesPerReplica)",
        "fieldPath": ".optimization.tensorParallel",
    }, {
        "rule": "!has(self.minReplicas) || self.minReplicas <= self.replicas",
        "message": "must be at most replicas (the gang's full size)",
        "fieldPath": ".minReplicas",
    }],
    "resources": [{
        "rule": "self.gpus == 0 || !has(self.processesPerReplica) || self.processesPerReplica == self.gpus",
        "message": "must equal resources.gpus on GPUs: one rank per GPU",
        "fieldPath": ".processesPerReplica",
    }],
    "training": [{
        "rule": "!has(self.schedule) || !has(self.schedule.warmupSteps) || self.schedule.warmupSteps <= self.steps",
        "message": "must be at most training.steps",
        "fieldPath": ".schedule.warmupSteps",
    }],
    "checkpoint": [{
        "rule": "!has(self.intervalSteps) || (type(self.intervalSteps) == int ? self.intervalSteps >= 1 "
                ": self.intervalSteps == 'auto')",
        "message": "must be a number of steps (at least 1) or auto",
        "fieldPath": ".intervalSteps",
    }, {
        "rule": "!has(self.intervalSteps) || !has(self.intervalSeconds)",
        "message": "intervalSteps and intervalSeconds both set: keep one of them",
        "fieldPath": ".intervalSeconds",
    }],
    "scheduling.topology": [{
        "rule": "self.policy == 'none' || !has(self.keys) || size(self.keys) > 0",
        "message": "a topology policy other than none needs at least one label key",
        "fieldPath": ".keys",
    }],
}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        ref = node.pop("$ref").split("/")[-1]
        merged = {**copy.deepcopy(defs[ref]), **node}
        return _structural(merged, defs)
    nullable = False
    for key in ("anyOf", "oneOf"):
        if key in node:
            all_options = node.pop(key)
            options = [o for o in all_options if o.get("type") != "null"]
            nullable = len(options) < len(all_options)
            if len(options) == 1:
                inner = _structural(options[0], defs)
                node = {**inner, **{k: v for k, v in node.items() if k not in inner or k == "description"}}
            elif not node.get("x-kubernetes-int-or-string"):  # int | "auto": int-or-string says all there is
                node["x-kubernetes-preserve-unknown-fields"] = True
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "prefixItems" in node:  # fixed-length tuples
        items = node.pop("prefixItems")
        node["items"] = _structural(items[0], defs)
        node["minItems"] = node["maxItems"] = len(items)
    if node.get("x-kubernetes-int-or-string"):
        node.pop("type", None)
    if node.get("additionalProperties") is False:
        node.pop("additionalProperties")
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _structural(node["additionalProperties"], defs)
    if node.get("additionalProperties") is True:
        node.pop("additionalProperties")
        node["x-kubernetes-preserve-unknown-fields"] = True
    # JSON Schema 2020 numeric exclusives -> OpenAPI v3 booleans
    for ex, base in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(ex), int | float) and not isinstance(node.get(ex), bool):
            node[base] = node.pop(ex)
            node[ex] = True
    if "properties" in node:
        node["properties"] = {k: _structural(v, defs) for k, v in node["properties"].items()}
        node.setdefault("type", "object")
    if "items" in node:
        node["items"] = _structural(node["items"], defs)
    if "enum" in node and "type" not in node:
        node["type"] = "string" if all(isinstance(e, str) for e in node["enum"]) else "integer"
    if not any(k in node for k in ("type", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields")):
        node["x-kubernetes-preserve-unknown-fields"] = True
    if "default" in node and (node["default"] is None or isinstance(node["default"], dict | list)):
        node.pop("default")  # object defaults come from the models, not the API server
    out = {k: v for k, v in node.items() if k in _KEEP}
    if nullable and "default" not in out:
        out["nullable"] = True
    return out


# ---- bounds on every stored user value: the API server refuses what no job needs before it reaches etcd, the
# operator's memory, or a CEL rule's cost estimate. Defaults for any string, list and map of the spec; tighter where
# Kubernetes has its own limit (names: DNS-1123 subdomains of 253, label values 63, qualified names 317, annotation
# values 256 KiB); a model's own max_length / max_items wins. Paths as in `bound_schema`'s walk: `.field`, `[]` an
# item, `{}` a map value, from spec.
DEFAULT_MAX_LENGTH = 4096  # PATH_MAX: image references, paths, URIs
DEFAULT_MAX_ITEMS = 1024
DEFAULT_MAX_PROPERTIES = 256
SUBDOMAIN, LABEL_VALUE, QUALIFIED = 253, 63, 317
EXPLICIT_BOUNDS: dict[str, dict[str, int]] = {
    "resources.gpuProduct": {"maxLength": LABEL_VALUE},  # a node label's value
    "model.preset": {"maxLength": LABEL_VALUE},
    "model.lora.targetModules": {"maxItems": 64},
    "model.lora.targetModules[]": {"maxLength": LABEL_VALUE},
    "data.jsonlField": {"maxLength": 256},
    "checkpoint.pvc": {"maxLength": SUBDOMAIN},
    "scheduling.queue": {"maxLength": SUBDOMAIN},
    "scheduling.priorityClassName": {"maxLength": SUBDOMAIN},
    "scheduling.topology.keys": {"maxItems": 16},
    "scheduling.topology.keys[]": {"maxLength": QUALIFIED},
    "scheduling.nodeSelector{}": {"maxLength": LABEL_VALUE},
    "scheduling.tolerations": {"maxItems": 64},
    "scheduling.tolerations[].key": {"maxLength": QUALIFIED},
    "scheduling.tolerations[].value": {"maxLength": LABEL_VALUE},
    "podTemplate.metadata.labels{}": {"maxLength": LABEL_VALUE},
    "podTemplate.metadata.annotations{}": {"maxLength": 256 * 1024},  # the total is checked by the webhook
    "podTemplate.spec.serviceAccountName": {"maxLength": SUBDOMAIN},
    "podTemplate.spec.containers": {"maxItems": 64},
    "podTemplate.spec.initContainers": {"maxItems": 64},
    "podTemplate.spec.volumes": {"maxItems": 256},
}


def bound_schema(node: dict[str, Any], path: str = "") -> dict[str, Any]:
    """`node` (a structural schema, changed in place) with maxLength / maxItems / maxProperties on every string,
    list and map below it: EXPLICIT_BOUNDS by path, else the defaults. Objects kept as written
    (x-kubernetes-preserve-unknown-fields: containers, volumes, affinity) are bounded by their list and by the
    webhook's document bounds (seqtrain.spec.bounds), not field by field."""
    explicit = EXPLICIT_BOUNDS.get(path, {})
    kind = node.get("type")
    if kind == "string" and "enum" not in node:
        node.setdefault("maxLength", explicit.get("maxLength", DEFAULT_MAX_LENGTH))
    elif kind == "array":
        node.setdefault("maxItems", explicit.get("maxItems", DEFAULT_MAX_ITEMS))
    elif kind == "object" and isinstance(node.get("additionalProperties"), dict):
        node.setdefault("maxProperties", explicit.get("maxProperties", DEFAULT_MAX_PROPERTIES))
    for key, sub in (node.get("properties") or {}).items():
        bound_schema(sub, f"{path}.{key}" if path else key)
    if isinstance(node.get("items"), dict):
        bound_schema(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        bound_schema(node["additionalProperties"], f"{path}{{}}")
    return node


def _schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)


def openapi_schema() -> dict[str, Any]:
    spec = bound_schema(_schema(JobSpec))
    for path, rules in CROSS_FIELD_RULES.items():
        node = spec
        for part in filter(None, path.split(".")):
            node = node["properties"][part]
        node["x-kubernetes-validations"] = rules
    status = _schema(JobStatus)
    status["x-kubernetes-preserve-unknown-fields"] = True
    return {
        "type": "object",
        "description": "A distributed training job for a sequence model.",
        "x-kubernetes-validations": [immutable_rule()],
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
    {"name": "Step", "type": "string", "jsonPath": ".status.progress.stepDisplay",
     "description": "step/totalSteps"},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss"},
    {"name": "Tok/s", "type": "number", "jsonPath": ".status.progress.tokensPerSecond"},
    {"name": "ETA", "type": "string", "jsonPath": ".status.progress.etaDisplay",
     "description": "time until totalSteps at the recent step rate"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{API_GROUP}"},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": SHORT_NAMES,
                "categories": ["all", "seqtrain"],
            },
            "versions": [
                {
                    "name": API_VERSION_NAME,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = "# GENERATED by `seqtrain crd` from seqtrain.spec: do not edit by hand (make crd).\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100, allow_unicode=True)


# ---- drift: an installed CRD older than this version -------------------------------------------------------------
UPGRADE_HINT = ("upgrade the CRD first (Helm never does): kubectl apply --server-side --force-conflicts -f "
                "charts/seqtrain/crds/seqtrainjob.yaml (or `seqtrain crd | kubectl apply --server-side "
                "--force-conflicts -f -`)")


def _missing(want: dict[str, Any], have: dict[str, Any], path: str) -> list[str]:
    if have.get("x-kubernetes-preserve-unknown-fields"):
        return []  # the installed schema keeps whatever is there
    out = []
    for key, sub in (want.get("properties") or {}).items():
        if key not in (have.get("properties") or {}):
            out.append(f"{path}.{key}")
        else:
            out += _missing(sub, have["properties"][key], f"{path}.{key}")
    if "items" in want and "items" in have:
        out += _missing(want["items"], have["items"], f"{path}[]")
    return out


def missing_fields(installed: dict[str, Any]) -> list[str]:
    """Spec fields this version knows that an installed CRD's schema lacks: the API server prunes them from every
    object written (or kubectl refuses them), so a job asks for something the operator never sees."""
    versions = [v for v in (installed.get("spec") or {}).get("versions") or [] if v.get("name") == API_VERSION_NAME]
    if not versions:
        return [f"{API_VERSION} (the installed CRD does not serve it)"]
    have = ((versions[0].get("schema") or {}).get("openAPIV3Schema") or {}).get("properties") or {}
    return _missing(openapi_schema()["properties"]["spec"], have.get("spec") or {}, "spec")


def drift_message(missing: list[str]) -> str:
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return (f"the installed CustomResourceDefinition {PLURAL}.{API_GROUP} is older than this seqtrain: it lacks "
            f"{shown}; the API server drops these fields from every job written; {UPGRADE_HINT}")

