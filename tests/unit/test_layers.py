"""The package layers of docs/architecture.md, enforced: a package imports only packages below it, never one above
(imports under `if TYPE_CHECKING:` are annotations and do not count). A new package must be placed in the table."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Bottom to top; a package may import packages of a lower rank (and itself).
LAYERS: dict[str, int] = {
    # torch-free floor: layout arithmetic and rules, the spec that names them, the kernels (own their fallbacks)
    "seqtrain.layout": 0,
    "seqtrain.kernels": 0,
    "seqtrain.hub": 0,  # the hf:// downloader (stdlib only); spec.init_source reads the layout it writes
    "seqtrain.spec": 1,
    "seqtrain.runtime": 2,
    "seqtrain.data": 3,
    "seqtrain.models": 4,
    "seqtrain.optim": 4,
    "seqtrain.checkpoint": 4,
    "seqtrain.parallel": 5,
    "seqtrain.engine": 6,
    "seqtrain.obs": 7,
    "seqtrain.train": 8,
    "seqtrain.benchmarks": 9,
    "seqtrain.export": 7,  # weights out (Hugging Face / safetensors) and in (model.init, which the loop reads)
    "seqtrain.generate": 9,
    "seqtrain.client": 10,  # a facade: forwards to seqtrain_operator.client on first use (torch-free)
    # operator: pure planner and controller core below the shells that do I/O
    "seqtrain_operator.planner": 0,
    "seqtrain_operator.controller": 1,
    "seqtrain_operator.k8s": 2,
    "seqtrain_operator.local": 2,
    "seqtrain_operator.client": 3,  # the user's client: Kubernetes calls and local runs behind one interface
    "seqtrain_operator.cli": 3,
    "seqtrain_operator.benchmark": 3,
    "seqtrain_operator.bench_recovery": 3,
    "seqtrain_operator.interval_bench": 3,
    "seqtrain_operator.chaos": 3,  # the chaos soak: a benchmark over the test control plane
}
# Inside the Kubernetes backend, its parts bottom to top (docs/architecture.md's module map lists them in this order):
# a module may import its own part and parts of a lower rank; the longest matching prefix names a module's part.
K8S_PARTS: dict[str, int] = {
    "seqtrain_operator.k8s.owner": 0,  # whose object: `Owner`, the uid and pod labels
    "seqtrain_operator.k8s.api": 1,
    "seqtrain_operator.k8s.webhook": 1,
    "seqtrain_operator.k8s.cache": 2,
    "seqtrain_operator.k8s.gangs": 3,  # below the pod builders, which import the adapters
    "seqtrain_operator.k8s.pods": 4,
    "seqtrain_operator.k8s.progress": 5,
    "seqtrain_operator.k8s.capacity": 5,
    "seqtrain_operator.k8s.settings": 5,
    "seqtrain_operator.k8s.passes": 6,
    "seqtrain_operator.k8s.process": 7,
    "seqtrain_operator.k8s.main": 8,
    "seqtrain_operator.k8s": 8,  # the package's own __init__ (a docstring)
}
# The operator image has no torch: from the trainer it may import only these torch-free packages/modules.
OPERATOR_MAY_IMPORT = ("seqtrain.spec", "seqtrain.layout", "seqtrain.runtime.exitcodes", "seqtrain.runtime.launch",
                       "seqtrain.runtime.restart", "seqtrain.train.metrics",
                       "seqtrain.checkpoint.discovery", "seqtrain.obs.push", "seqtrain.obs.httpserve",
                       "seqtrain.optim.schedules")  # the local runner makes the trainer's resume check of training.steps
# The one console script: its trainer commands (train, report, bench, ...) import the trainer inside the command
# function, so `seqtrain validate` and `seqtrain operator` stay torch-free; only its module-level imports count.
LAZY_ENTRY_POINTS = {"seqtrain_operator.cli"}


def _modules(src: str) -> dict[str, pathlib.Path]:
    base = ROOT / src
    out = {}
    for p in base.rglob("*.py"):
        parts = list(p.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = {**_modules("trainer"), **_modules("operator")}


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def imports_of(module: str, top_level_only: bool = False) -> set[str]:
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in nodes:
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:  # `from seqtrain import kernels` imports the module seqtrain.kernels
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return {m for m in found if m.split(".")[0] in ("seqtrain", "seqtrain_operator")}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    for n in (2, 1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    return None


OWN = sorted(m for m in MODULES if m not in ("seqtrain", "seqtrain_operator"))


@pytest.mark.parametrize("module", OWN)
def test_every_module_belongs_to_a_layer(module: str) -> None:
    assert package_of(module) is not None, f"{module}: add its package to LAYERS in {__file__} (and the diagram)"


@pytest.mark.parametrize("module", OWN)
def test_imports_go_downward_only(module: str) -> None:
    mine = package_of(module)
    if mine is None:
        pytest.skip("not placed")
    bad = []
    for target in sorted(imports_of(module, top_level_only=module in LAZY_ENTRY_POINTS)):
        theirs = package_of(target)
        if theirs is None or theirs == mine:
            continue
        if mine.startswith("seqtrain_operator") and theirs.startswith("seqtrain."):
            if not target.startswith(OPERATOR_MAY_IMPORT):
                bad.append(f"{target} (the operator may import only {', '.join(OPERATOR_MAY_IMPORT)})")
            continue
        if mine.startswith("seqtrain.") and theirs.startswith("seqtrain_operator") and mine not in (
                "seqtrain.benchmarks", "seqtrain.client"):
            bad.append(f"{target} (the trainer does not import the operator)")
            continue
        if LAYERS[theirs] >= LAYERS[mine] and mine.split(".")[0] == theirs.split(".")[0]:
            bad.append(f"{target} ({theirs} is layer {LAYERS[theirs]}, {mine} is layer {LAYERS[mine]})")
    assert not bad, f"{module} imports upward or sideways: " + "; ".join(bad)


def k8s_part_of(module: str) -> str | None:
    parts = module.split(".")
    return next((".".join(parts[:n]) for n in range(len(parts), 1, -1) if ".".join(parts[:n]) in K8S_PARTS), None)


K8S_MODULES = sorted(m for m in MODULES if k8s_part_of(m))


@pytest.mark.parametrize("module", K8S_MODULES)
def test_k8s_parts_import_downward_only(module: str) -> None:
    mine = k8s_part_of(module)
    assert mine is not None
    bad = [f"{target} ({theirs} is rank {K8S_PARTS[theirs]}, {mine} is rank {K8S_PARTS[mine]})"
           for target in sorted(imports_of(module))
           if (theirs := k8s_part_of(target)) and theirs != mine and K8S_PARTS[theirs] >= K8S_PARTS[mine]]
    assert not bad, f"{module} imports a k8s part at or above its own (see K8S_PARTS): " + "; ".join(bad)


def test_every_k8s_subpackage_is_placed() -> None:
    k8s = ROOT / "operator" / "seqtrain_operator" / "k8s"
    packages = sorted(f"seqtrain_operator.k8s.{p.parent.name}" for p in k8s.glob("*/__init__.py"))
    assert [p for p in packages if p not in K8S_PARTS] == [], f"add each to K8S_PARTS in {__file__}"


def test_the_k8s_part_reader_takes_the_longest_prefix() -> None:
    assert k8s_part_of("seqtrain_operator.k8s.owner") == "seqtrain_operator.k8s.owner"
    assert k8s_part_of("seqtrain_operator.k8s.progress.push") == "seqtrain_operator.k8s.progress"
    assert k8s_part_of("seqtrain_operator.k8s.gangs.kai") == "seqtrain_operator.k8s.gangs"
    assert k8s_part_of("seqtrain_operator.k8s") == "seqtrain_operator.k8s"
    assert k8s_part_of("seqtrain_operator.planner.queue") is None


def test_no_import_cycle_between_modules() -> None:
    graph = {m: {t for t in imports_of(m) if t in MODULES and t != m} for m in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            pytest.fail("import cycle: " + " -> ".join(cycle))
