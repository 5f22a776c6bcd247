"""CRD generation from the spec models: pydantic JSON Schema -> Kubernetes structural openAPIV3Schema.

`crds/seqtrainjob.yaml` and the Helm chart's copy are this module's output; a test keeps them byte-equal.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from .job import API_GROUP, API_VERSION_NAME, KIND, PLURAL, SHORT_NAMES, JobSpec
from .status import JobStatus

# Keys of JSON Schema that Kubernetes' OpenAPI v3 subset understands (others are dropped).
_KEEP = {
    "type", "properties", "items", "additionalProperties", "description", "enum", "default", "format",
    "minimum", "maximum", "minItems", "maxItems", "minLength", "maxLength", "pattern", "nullable",
    "required", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
    "exclusiveMinimum", "exclusiveMaximum",
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
            else:
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


def _schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)


def openapi_schema() -> dict[str, Any]:
    spec = _schema(JobSpec)
    status = _schema(JobStatus)
    status["x-kubernetes-preserve-unknown-fields"] = True
    return {
        "type": "object",
        "description": "A distributed training job for a sequence model.",
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
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss"},
    {"name": "Tok/s", "type": "number", "jsonPath": ".status.progress.tokensPerSecond"},
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
