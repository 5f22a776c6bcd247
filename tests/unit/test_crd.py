"""The CRD is generated from the spec models; the committed copies must be exactly that output."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import yaml

from seqtrain.spec.crd import crd, crd_yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_committed_crd_is_generated_output():
    assert (ROOT / "crds/seqtrainjob.yaml").read_text() == crd_yaml(), "run `make crd` after changing the spec"


def test_chart_crd_is_generated_output():
    assert (ROOT / "charts/seqtrain/crds/seqtrainjob.yaml").read_text() == crd_yaml(), "run `make crd`"


@pytest.mark.slow
def test_cli_prints_same_crd():
    out = subprocess.run([sys.executable, "-m", "seqtrain_operator.cli", "crd"], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout == crd_yaml()


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.get("properties", {}).items():
            yield from _walk(v, f"{path}.{k}")
        if isinstance(node.get("items"), dict):
            yield from _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    version = crd()["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        # every node has a type (or is an explicit int-or-string / preserve-unknown escape hatch)
        assert "type" in node or node.get("x-kubernetes-int-or-string") or node.get(
            "x-kubernetes-preserve-unknown-fields"), path
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "const", "title", "prefixItems", "$defs"):
            assert banned not in node, f"{path} has {banned}"
        assert node.get("additionalProperties") is not False, path
        if "properties" in node:
            assert "additionalProperties" not in node, f"{path}: properties and additionalProperties both set"
    spec = schema["properties"]["spec"]["properties"]
    assert spec["model"]["properties"]["arch"]["enum"] == ["gpt", "lstm", "gru", "qrnn"]
    assert spec["faultTolerance"]["properties"]["maxRestarts"]["minimum"] == 0
    assert spec["resources"]["properties"]["cpu"]["x-kubernetes-int-or-string"] is True


def test_status_subresource_columns_and_names():
    doc = yaml.safe_load(crd_yaml())
    v = doc["spec"]["versions"][0]
    assert v["subresources"] == {"status": {}}
    assert [c["name"] for c in v["additionalPrinterColumns"]] == [
        "Phase", "Replicas", "Step", "Loss", "Tok/s", "ETA", "Restarts", "Age"]
    step = next(c for c in v["additionalPrinterColumns"] if c["name"] == "Step")
    assert step["jsonPath"] == ".status.progress.stepDisplay"  # N/TOTAL: spec.status.Progress writes it
    assert "stj" in doc["spec"]["names"]["shortNames"]
    assert doc["metadata"]["name"] == "seqtrainjobs.seqtrain.dev"


def test_spec_reference_is_generated_and_complete():
    from seqtrain.spec.reference import markdown

    text = markdown()
    assert (ROOT / "docs/spec-reference.md").read_text() == text, "run `make crd` after changing the spec"
    rows = [line for line in text.splitlines() if line.startswith("| `spec.")]
    assert len(rows) > 100
    undocumented = [r.split("|")[1].strip() for r in rows if r.rstrip().endswith("|  |")]
    assert not undocumented, f"fields without a description: {undocumented}"


def test_cel_rules_guard_running_gangs_and_cross_field_rules_and_name_real_fields():
    """The API stays safe without the webhook (evaluated by a real kube-apiserver in
    tests/integration/test_operator_real.py); here: the rules are in the generated CRD and every field they name
    exists in the schema."""
    from seqtrain.spec.crd import CROSS_FIELD_RULES, IMMUTABLE_WHILE_RUNNING

    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    (rule,) = schema["x-kubernetes-validations"]
    assert "oldSelf.status.phase in ['Scheduling', 'Running', 'Restarting']" in rule["rule"]
    assert "spec.suspend" in rule["message"]

    def node(path: str) -> dict:
        n = schema["properties"]["spec"]
        for part in filter(None, path.split(".")):
            n = n["properties"][part]
        return n

    for path, _ in IMMUTABLE_WHILE_RUNNING:
        node(path)
        assert f"self.spec.{path}" in rule["rule"] and f"oldSelf.spec.{path}" in rule["rule"]
    for path, rules in CROSS_FIELD_RULES.items():
        assert node(path)["x-kubernetes-validations"] == rules
        for r in rules:
            node(f"{path}.{r['fieldPath'].lstrip('.')}".lstrip("."))


def test_an_older_installed_crd_is_named_with_the_fields_it_lacks_and_the_fix():
    import copy

    from seqtrain.spec.crd import crd, drift_message, missing_fields

    current = crd()
    assert missing_fields(current) == []
    old = copy.deepcopy(current)
    spec = old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    del spec["minReplicas"]
    del spec["faultTolerance"]["properties"]["imagePullTimeoutSeconds"]
    missing = missing_fields(old)
    assert missing == ["spec.minReplicas", "spec.faultTolerance.imagePullTimeoutSeconds"]
    msg = drift_message(missing)
    assert "lacks spec.minReplicas, spec.faultTolerance.imagePullTimeoutSeconds" in msg
    assert "kubectl apply --server-side --force-conflicts -f charts/seqtrain/crds/seqtrainjob.yaml" in msg
    old["spec"]["versions"][0]["name"] = "v1beta9"
    assert missing_fields(old) == ["seqtrain.dev/v1alpha1 (the installed CRD does not serve it)"]


def _walk(node: dict, path: str = ""):
    yield path, node
    for key, sub in (node.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}" if path else key)
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_every_stored_user_value_is_bounded():
    """maxLength / maxItems / maxProperties on every string, list and map of the spec (the API server refuses a
    1.5 MB spec before the operator keeps it), tighter where Kubernetes has its own limit."""
    from seqtrain.spec.crd import EXPLICIT_BOUNDS

    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    nodes = dict(_walk(spec))
    assert set(EXPLICIT_BOUNDS) <= set(nodes), set(EXPLICIT_BOUNDS) - set(nodes)  # no bound lost to a rename
    for path, node in nodes.items():
        if node.get("type") == "string" and "enum" not in node:
            assert node.get("maxLength"), path
        if node.get("type") == "array":
            assert node.get("maxItems"), path
        if node.get("type") == "object" and isinstance(node.get("additionalProperties"), dict):
            assert node.get("maxProperties"), path
    assert nodes["podTemplate.metadata.labels{}"]["maxLength"] == 63
    assert nodes["podTemplate.spec.serviceAccountName"]["maxLength"] == 253
    assert nodes["podTemplate.metadata.annotations{}"]["maxLength"] == 256 * 1024
