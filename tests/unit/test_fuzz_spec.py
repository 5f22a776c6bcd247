"""Fuzzing the spec surfaces with generated hostile input: the YAML loader and `seqtrain validate`, `--set`
overrides, the pod policy, the manifest builders behind a valid spec, and the webhook's AdmissionReview handler.

The invariant everywhere: a SpecError whose problems are one line each (or a valid job), an AdmissionReview that
admits or refuses with one line and never a 500, and for every job that validates, pods that can be built and
encoded as JSON the API server accepts; never another exception, a hang or an expansion without bound. Inputs that
once broke one of these stay below as explicit examples.
"""

from __future__ import annotations

import asyncio
import copy
import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from webhook_engine import answer, engine, review_of

from seqtrain.spec import SpecError, load_jobs, parse_job
from seqtrain.spec.load import apply_overrides
from seqtrain.spec.policy import PodPolicy, job_policy_problems, pod_spec_problems
from seqtrain_operator.k8s.owner import Owner
from seqtrain_operator.k8s.pods import manifests as m

pytestmark = pytest.mark.fuzz
LEVELS_ = ["privileged", "baseline", "restricted"]
ROOT = pathlib.Path(__file__).resolve().parents[2]

BASE: dict[str, Any] = {
    "apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "j", "namespace": "ml"},
    "spec": {
        "replicas": 2, "resources": {"cpu": "1", "memory": "1Gi"},
        "training": {"steps": 10, "globalBatchSize": 4, "microBatchSize": 2},
        "checkpoint": {"path": "/checkpoints/j/ck", "keep": 2},
        "scheduling": {"tolerations": [{"key": "gpu", "operator": "Exists"}], "nodeSelector": {"pool": "a"}},
        "podTemplate": {
            "metadata": {"labels": {"team": "ml"}, "annotations": {"note": "x"}},
            "spec": {
                "containers": [
                    {"name": "trainer", "env": [{"name": "HF_HOME", "value": "/data"}],
                     "volumeMounts": [{"name": "data", "mountPath": "/data"}]},
                    {"name": "side", "image": "busybox", "args": ["sleep", "1"],
                     "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
                "initContainers": [{"name": "init", "image": "busybox"}],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}],
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "In", "values": ["v"]}]}]}}},
            }}}}


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*path, i))
    return out


PATHS = [p for p in _paths(BASE) if p]

# Values no spec field should take: wrong types, huge and odd numbers, long and odd strings, deep nesting.
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2**63 - 2, max_value=2**70),
    st.sampled_from([10**4000, -(10**40), 2**63, 0, -1]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([float("nan"), float("inf"), -0.0, 1e308]),
    st.text(max_size=40), st.text(alphabet=st.characters(codec="utf-8"), max_size=20),
    st.sampled_from(["", " ", "../..", "/checkpoints/other", "ALL", "SYS_ADMIN", "Bidirectional", "a" * 300,
                     "x" * 70_000, "\x00", "\ud800", "${HOME}", "$(rm -rf /)", "trainer", "RANK", "1e999"]),
)
VALUES = st.recursive(SCALARS, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=12), kids, max_size=4)), max_leaves=12)


def deep(depth: int) -> Any:
    node: Any = "leaf"
    for i in range(depth):
        node = {"a": node} if i % 2 else [node]
    return node


def _put(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    node: Any = doc
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return doc


def one_line_problems(err: SpecError) -> None:
    assert err.problems, "a SpecError without problems"
    for p in err.problems:
        assert p.path and p.message and "\n" not in str(p) and "Traceback" not in str(p), repr(p)


def buildable(job: Any) -> None:
    """A valid job is checkable by every policy level and builds into pods whose JSON the API server accepts."""
    for level in ("privileged", "baseline", "restricted"):
        for p in job_policy_problems(job.spec, PodPolicy.of(level), job.name):
            assert p.path and p.message and "\n" not in p.message, repr(p)
    gang = m.build_gang(job, Owner(job.name, "ml", "uid"), 1, m.Settings(), None)
    for obj in (*gang.pods, gang.configmap):
        json.dumps(obj, allow_nan=False)  # NaN, Infinity or a non-JSON value would be refused by the API server


def holds(doc: Any) -> str:
    """The invariant for one decoded document: refused in one line per problem, or valid and buildable. Returns
    "refused" or "valid"."""
    try:
        job = parse_job(doc)
    except SpecError as err:
        one_line_problems(err)
        return "refused"
    buildable(job)
    return "valid"


def holds_for_text(text: str, sets: tuple[str, ...] = ()) -> str:
    try:
        jobs = load_jobs(text, sets)
    except SpecError as err:
        one_line_problems(err)
        return "refused"
    for job in jobs:
        buildable(job)
    return "valid"


# ---- the decoded document: a hostile value at every level of a valid job ---------------------------------------
@given(st.sampled_from(PATHS), VALUES)
@example(("spec", "podTemplate", "spec", "affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution"),
         "x")  # passed validation, then build_pod raised AttributeError on every reconcile pass
@example(("spec", "podTemplate", "spec", "containers", 1, "env"), 5)  # enumerate(5): TypeError in the checks
@example(("spec", "podTemplate", "spec", "containers", 1, "ports"), [{"containerPort": [1]}])  # unhashable port
@example(("spec", "podTemplate", "spec", "containers", 0, "volumeMounts"), [{"name": ["x"], "mountPath": "/d"}])
@example(("spec", "podTemplate", "spec", "containers", 1, "args"), [float("nan")])  # NaN in a pod: API refuses
@example(("spec", "podTemplate", "spec", "containers", 1, "args"), [10**30])  # beyond int64
@example(("spec", "podTemplate", "spec", "affinity", "podAffinity"), deep(40))  # RecursionError at 1000
@example(("spec", "training", "steps"), 10**4000)
@example(("metadata",), {"\n": 2**63})  # a key with a newline split a problem over two lines
@example(("spec", "podTemplate", "metadata", "annotations", "note"), "\ud800")  # UnicodeEncodeError in a size sum
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_a_hostile_value_anywhere_is_refused_in_one_line_or_builds(path: tuple[Any, ...], value: Any) -> None:
    holds(_put(BASE, path, value))


# Containers and volumes built from core/v1's own keys with hostile values: the template checks, the policy and the
# pod merge all walk these, so the shapes they assume are what is fuzzed.
CONTAINER_KEYS = ["name", "image", "env", "envFrom", "volumeMounts", "ports", "securityContext", "resources", "args",
                  "restartPolicy"]
LIGHT = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(
    [float("nan"), 1.5, 2**64, "", "ALL", "SYS_ADMIN", "Bidirectional", "/checkpoints", "/etc", "RANK", "x" * 70]),
    st.text(max_size=10)), lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids,
                                                                                       max_size=3), max_leaves=6)
NAMES = st.sampled_from(["trainer", "side", "init", "", "Trainer", "a" * 64, "x.y"]) | st.text(max_size=8)
SHAPED = st.one_of(LIGHT, st.lists(st.dictionaries(st.sampled_from(
    ["name", "value", "valueFrom", "secretRef", "configMapRef", "prefix", "mountPath", "mountPropagation",
     "containerPort", "hostPort", "capabilities", "add", "drop", "limits", "requests", "rdma/ib", "secretKeyRef"]),
    LIGHT, max_size=3), max_size=3))
CONTAINERS = st.lists(st.fixed_dictionaries({"name": NAMES}, optional={
    k: SHAPED for k in CONTAINER_KEYS if k != "name"}), max_size=3)
VOLUMES = st.lists(st.fixed_dictionaries({"name": NAMES}, optional={k: SHAPED | st.fixed_dictionaries({}, optional={
    "secretName": LIGHT, "sources": SHAPED, "path": LIGHT, "nodePublishSecretRef": LIGHT, "claimName": LIGHT})
    for k in ["secret", "projected", "hostPath", "csi", "persistentVolumeClaim", "emptyDir", "nfs"]}), max_size=3)
AFFINITY = st.fixed_dictionaries({}, optional={k: SHAPED | st.fixed_dictionaries({}, optional={
    "requiredDuringSchedulingIgnoredDuringExecution": SHAPED | st.fixed_dictionaries(
        {"nodeSelectorTerms": st.lists(SHAPED | st.fixed_dictionaries({}, optional={
            "matchExpressions": SHAPED, "matchFields": SHAPED}), max_size=2)}),
    "preferredDuringSchedulingIgnoredDuringExecution": SHAPED}) for k in ["nodeAffinity", "podAffinity", "x"]})


@given(CONTAINERS, CONTAINERS, VOLUMES, AFFINITY | st.none())
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_hostile_pod_templates_are_refused_in_one_line_or_build(containers: list[Any], init: list[Any],
                                                                volumes: list[Any], affinity: Any) -> None:
    template: dict[str, Any] = {"containers": containers, "initContainers": init, "volumes": volumes}
    if affinity is not None:
        template["affinity"] = affinity
    holds(_put(BASE, ("spec", "podTemplate", "spec"), template))


POD_KEYS = ["hostNetwork", "securityContext", "containers", "initContainers", "ephemeralContainers", "volumes",
            "nodeSelector", "affinity", "tolerations", "serviceAccountName", "automountServiceAccountToken",
            "priorityClassName", "imagePullSecrets"]


@given(st.dictionaries(st.sampled_from(POD_KEYS), SHAPED | st.lists(st.fixed_dictionaries({}, optional={
    k: SHAPED for k in ["name", "securityContext", "env", "envFrom", "volumeMounts", "secret", "projected", "csi",
                        "hostPath", "ports"]}), max_size=3), max_size=6), st.sampled_from(LEVELS_),
       st.dictionaries(st.text(max_size=50), st.text(max_size=5), max_size=2))
@example({"containers": [{"name": [1]}]}, "baseline", {})  # `name in hardened` hashed a list: TypeError
@example({"priorityClassName": [1]}, "baseline", {})
def test_the_generic_pod_check_never_raises(spec: dict[str, Any], level: str, annotations: dict[str, str]) -> None:
    """pod_spec_problems takes any PodSpec-shaped dict (the operator checks its own pods with it too)."""
    for path, message in pod_spec_problems(spec, PodPolicy.of(level), annotations=annotations):
        assert path and message and "\n" not in message


@given(st.integers(min_value=33, max_value=5000))
@example(5000)
def test_nesting_at_any_depth_is_refused_without_recursion(depth: int) -> None:
    doc = _put(BASE, ("spec", "podTemplate", "spec", "affinity", "podAffinity"), {"x": deep(depth)})
    assert holds(doc) == "refused"


# ---- the YAML text --------------------------------------------------------------------------------------------
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi",
                                                                                         strict=True))
HOSTILE_TEXTS = [
    BOMB,  # billion laughs: a few hundred bytes, 9**9 nodes expanded
    "apiVersion: seqtrain.dev/v1alpha1\nkind: SeqTrainJob\nmetadata: {name: j}\nspec:\n  training: {steps: "
    + "9" * 5001 + "}\n",  # ValueError from int() (Python's int-string limit): a traceback from validate
    "apiVersion: seqtrain.dev/v1alpha1\nkind: SeqTrainJob\nmetadata: {name: j, created: 2024-13-45}\n",  # ValueError
    "!!python/object/apply:os.system ['echo pwned']\n",
    "a: !!python/name:os.system\n",
    "a: 1\na: 2\n",
    "[" * 5000 + "]" * 5000,  # seconds inside PyYAML before its RecursionError: refused by a bracket count first
    "{a: " * 3000 + "1" + "}" * 3000,
    "- " * 3000 + "x",
    "".join(" " * i + "a:\n" for i in range(1200)),  # block nesting: PyYAML's RecursionError, caught
    "a: &a [x]\n" + "".join(f"a{i}: &a{i} [*{'a' if i == 0 else f'a{i - 1}'}]\n" for i in range(60)),  # deep by aliases
    "- &x [*x]\n",
    "a: !!binary AAAA\n",
    "a: !!set {x, y}\n",
    "\t: :\n",
    "%YAML 9.9\n---\na: 1\n",
    "a: *nope\n",
    "--- 1\n--- [2]\n--- {kind: SeqTrainJob}\n",
]


@given(st.sampled_from(HOSTILE_TEXTS) | st.text(max_size=200) | VALUES.map(
    lambda v: yaml.safe_dump({"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {
        "name": "j"}, "spec": v}, allow_unicode=True) if not _unsafe_for_dump(v) else "x: 1"))
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_hostile_yaml_text_is_refused_in_one_line(text: str) -> None:
    holds_for_text(text)


def _unsafe_for_dump(v: Any) -> bool:
    try:
        yaml.safe_dump(v)
    except (yaml.YAMLError, ValueError, TypeError, RecursionError):
        return True
    return False


@pytest.mark.parametrize("text", HOSTILE_TEXTS, ids=range(len(HOSTILE_TEXTS)))
def test_each_known_hostile_text(text: str) -> None:
    assert holds_for_text(text) == "refused"


# ---- --set overrides -------------------------------------------------------------------------------------------
SET_PATHS = st.sampled_from([".".join(str(p) for p in path if not isinstance(p, int)) for path in PATHS]) | \
    st.text(max_size=30)


@given(st.lists(st.tuples(SET_PATHS, st.sampled_from([
    "9" * 5001, "[" * 3000, "{a: " * 40 + "1" + "}" * 40, "&a [*a]", "!!python/object:os.system {}", "2024-13-45", ".nan", "{a: 1, a: 2}",
    "null", "", "=", "x=y"]) | st.text(max_size=30)).map(lambda kv: f"{kv[0]}={kv[1]}"), max_size=3))
@example(["training.steps=" + "9" * 5001])  # ValueError from yaml.safe_load: a traceback before
@example(["training.steps=" + "[" * 3000])  # RecursionError from yaml.safe_load
@example(["metadata.name=2024-13-45"])
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_set_overrides_are_refused_in_one_line_or_apply(sets: list[str]) -> None:
    holds_for_text(yaml.safe_dump(BASE), tuple(sets))


def test_set_keeps_text_that_is_not_yaml_and_refuses_what_cannot_be_read() -> None:
    doc = apply_overrides(copy.deepcopy(BASE), ["metadata.annotations=a: b: c"])
    assert doc["metadata"]["annotations"] == "a: b: c"
    with pytest.raises(SpecError) as err:
        apply_overrides(copy.deepcopy(BASE), ["training.steps=" + "9" * 5001])
    assert err.value.problems[0].path == "--set" and "digits" in err.value.problems[0].message


# ---- the webhook's AdmissionReview handler --------------------------------------------------------------------
def _admits_or_refuses_in_one_line(review: dict[str, Any]) -> bool:
    response = review["response"]
    if response["allowed"]:
        return True
    status = response["status"]
    assert status["code"] != 500 and 400 <= status["code"] < 500, status
    assert status["message"] and "\n" not in status["message"] and "Traceback" not in status["message"], status
    return False


RAW_MUTATIONS = st.sampled_from(["truncate", "flip", "prefix", "none"])
ENGINE = engine()


@given(st.sampled_from(PATHS), VALUES, RAW_MUTATIONS, st.integers(min_value=0, max_value=10**6),
       st.sampled_from(["CREATE", "UPDATE"]))
@example(("spec", "podTemplate", "spec", "affinity", "podAffinity"), deep(400), "none", 0, "CREATE")
@example(("spec", "training", "steps"), 10**4000, "none", 0, "UPDATE")
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_the_webhook_answers_every_body_with_an_admission_review(path: tuple[Any, ...], value: Any, mutation: str,
                                                                 where: int, operation: str) -> None:
    doc = _put(BASE, path, value)
    old = BASE if operation == "UPDATE" else None
    try:
        raw = json.dumps(review_of(doc, operation, old)).encode("utf-8", "surrogatepass")
    except (ValueError, RecursionError):
        raw = b'{"request": {"uid": "req-1"}}'
    at = where % max(1, len(raw))
    raw = {"truncate": raw[:at], "flip": raw[:at] + bytes([raw[at] ^ 0x55]) + raw[at + 1:] if raw else raw,
           "prefix": b"\xef\xbb\xbf" + raw, "none": raw}[mutation]
    review = asyncio.run(answer(raw, ENGINE))
    allowed = _admits_or_refuses_in_one_line(review)
    if mutation == "none" and operation == "CREATE" and not allowed:  # refused: the spec or the policy says why
        assert holds(doc) == "refused" or job_policy_problems(parse_job(doc).spec, PodPolicy.of(), "j")


# ---- `seqtrain validate` as a user runs it: exit 2, one line per problem, no traceback --------------------------
@pytest.mark.slow
def test_validate_exits_2_with_one_line_per_problem_for_the_worst_files(tmp_path: pathlib.Path) -> None:
    files = []
    deep_json = json.dumps(_put(BASE, ("spec", "podTemplate", "spec", "affinity", "podAffinity"), "MARK")).replace(
        '"MARK"', "[" * 5000 + "]" * 5000)
    for i, text in enumerate([*HOSTILE_TEXTS[:4], deep_json]):
        f = tmp_path / f"hostile-{i}.yaml"
        f.write_text(text)
        files.append(str(f))
    out = subprocess.run([sys.executable, "-m", "seqtrain_operator.cli", "validate", *files], capture_output=True,
                         text=True, timeout=120, cwd=ROOT,
                         env={"PYTHONPATH": f"{ROOT / 'trainer'}:{ROOT / 'operator'}", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert sorted({line.split(":", 1)[0] for line in lines}) == sorted(files), out.stderr
    assert all(len(line) < 600 for line in lines), out.stderr
