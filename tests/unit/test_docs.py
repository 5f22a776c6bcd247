"""The user-facing docs stay true to the code: examples validate, links resolve, field paths and commands exist.

Cheap checks only (no training, no torch import): the spec models, the CLI parser and the files.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
from pydantic import BaseModel

from seqtrain.spec.job import JobSpec
from seqtrain.spec.load import load_job  # noqa: F401  (import proves the loader the CLI uses is importable)
from seqtrain.spec.reference import _submodel  # the same walk the generated reference uses
from seqtrain_operator.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _spec_paths(model: type[BaseModel] = JobSpec, prefix: str = "spec") -> set[str]:
    """Every field path of the spec as written in YAML (camelCase), lists of objects without an index."""
    out: set[str] = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}.{field.alias or name}"
        out.add(path)
        sub = _submodel(field.annotation)
        if sub is not None:
            out |= _spec_paths(sub, path)
    return out


SPEC_PATHS = _spec_paths()
# how the docs write "some field" in the `FILE: spec.path: message` format of seqtrain validate
PLACEHOLDERS = {"path", "path.to.field"}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = "".join(c for c in text if c in " -" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    slugs: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        slug, n = _slug(heading), 0
        while (slug if n == 0 else f"{slug}-{n}") in slugs:
            n += 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def _links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return [a or b for a, b in LINK.findall(text)]


def test_spec_paths_come_from_the_models() -> None:
    # guards the derivation itself: a walk that found nothing would make the field check below vacuous
    assert {"spec.training.steps", "spec.optimization.zero.stage", "spec.scheduling.tolerations.key"} <= SPEC_PATHS
    assert "spec.training.stepz" not in SPEC_PATHS


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["validate", str(example)])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in _links(doc):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{doc.name}: broken links:\n" + "\n".join(broken)


def test_link_checker_catches_a_broken_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top\n\n## How dispatch reaches the models (`x`)\n", encoding="utf-8")
    assert "how-dispatch-reaches-the-models-x" in _anchors(tmp_path / "a.md")
    assert "missing" not in _anchors(tmp_path / "a.md")


def test_spec_fields_named_in_the_user_guide_exist() -> None:
    text = (ROOT / "docs" / "user-guide.md").read_text(encoding="utf-8")
    top = {p.split(".")[1] for p in SPEC_PATHS}
    # `spec.x.y` anywhere, and `x.y` inside backticks when x is a top-level spec section (training.steps ...)
    # (not followed by more name characters, a slash or `:7`: API groups like scheduling.x-k8s.io/..., files)
    end = r"(?![\w./-]|:\S)"
    named = set(re.findall(r"(?<![\w.])spec\.([A-Za-z]\w*(?:\.[A-Za-z]\w*)*)" + end, text))
    sections = "|".join(sorted(top))
    for code in re.findall(r"`([^`\n]+)`", text):
        named |= set(re.findall(rf"(?<![\w./-])((?:{sections})(?:\.[A-Za-z]\w*)+){end}", code))
    named -= PLACEHOLDERS
    assert len(named) > 20, "the user guide names spec fields; the pattern found almost none"
    unknown = sorted(p for p in named if f"spec.{p}" not in SPEC_PATHS)
    assert not unknown, "user guide names spec fields that do not exist: " + ", ".join(unknown)


def test_readme_commands_are_real_subcommands() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("## Commands", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"^\| `seqtrain (\w[\w-]*)", table, re.M)
    assert len(named) >= 6, "the README's command table lists the seqtrain commands"
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    missing = sorted(set(named) - set(sub.choices))
    assert not missing, f"README names commands seqtrain does not have: {missing}"
    bench = re.search(r"`seqtrain bench ([\w\\|-]+)`", table)
    assert bench, "README lists the benchmarks"
    names = set(bench.group(1).replace("\\", "").split("|"))
    choices = next(a for a in sub.choices["bench"]._actions if a.dest == "name").choices
    assert names == set(choices), f"README's benchmarks {sorted(names)} != seqtrain bench's {sorted(choices)}"


def test_readme_says_in_which_order_make_install_gets_torch() -> None:
    """The README's install sentence follows the Makefile's `$(STAMP)` recipe: without a driver, PyPI's default torch
    (on Linux the CUDA build) first, PyTorch's CPU index only when that fails (it said "the CPU build first")."""
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    found = re.search(r"^TORCH_VERSION \?= (\S+)", make, re.M)
    assert found is not None
    recipe = make[make.index("$(STAMP): "):]
    tries = [ln.strip() for ln in recipe.splitlines() if '"torch==$(TORCH_VERSION)"' in ln]
    assert len(tries) == 2, tries
    assert "--index-url" not in tries[0], "the Makefile's first torch install changed: update the README's sentence"
    assert tries[1].startswith("||") and "download.pytorch.org/whl/cpu" in tries[1]
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "installs the CPU build of torch" not in readme
    assert f"the Makefile first installs torch {found.group(1)} from PyPI's default index" in readme
    assert "only when that install fails does it fall back to the CPU build from PyTorch's CPU index" in readme


# ---- the README's Kubernetes section and the images it uses (issue 17) -------------------------------------------


def _make_images() -> list[str]:
    import subprocess

    out = subprocess.run(["make", "-s", "--no-print-directory", "print-images"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def _kubernetes_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    at = text.index("On Kubernetes")
    block = FENCE.search(text, at)
    assert block is not None
    return [ln.split("#")[0].strip() for ln in block.group(0).splitlines()[1:-1] if ln.split("#")[0].strip()]


@pytest.mark.slow
def test_default_images_are_what_make_images_builds() -> None:
    import yaml

    from seqtrain.spec.job import DEFAULT_IMAGE

    trainer, operator = _make_images()
    mk = (ROOT / "Makefile").read_text()
    assert "scripts/images.sh $(TRAINER_IMAGE) $(OPERATOR_IMAGE)" in mk  # tags them with these names
    assert trainer == DEFAULT_IMAGE  # the spec's default trainer image
    chart = yaml.safe_load((ROOT / "charts" / "seqtrain" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "seqtrain" / "values.yaml").read_text())
    tag = values["image"]["tag"] or chart["appVersion"]  # the deployment template's default
    assert f"{values['image']['repository']}:{tag}" == operator
    assert values["image"]["pullPolicy"] == "IfNotPresent"  # an image loaded into kind is used, not pulled
    version = re.search(r'^version = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)  # type: ignore[union-attr]
    assert chart["appVersion"] == chart["version"] == version
    assert trainer.endswith(f":{version}") and operator.endswith(f":{version}")


@pytest.mark.slow
def test_readme_kubernetes_section_is_a_working_sequence() -> None:
    import yaml

    cmds = _kubernetes_block()
    images = _make_images()

    def index(prefix: str) -> int:
        hits = [i for i, c in enumerate(cmds) if c.startswith(prefix)]
        assert hits, f"README's Kubernetes section lacks `{prefix}`:\n" + "\n".join(cmds)
        return hits[0]

    order = ["mkdir -p /tmp/seqtrain-ckpt", "kind create cluster --name seqtrain --config examples/kind/cluster.yaml",
             "make images", "kind load docker-image --name seqtrain", "helm install seqtrain charts/seqtrain",
             "kubectl apply -f examples/kind/checkpoint-volume.yaml", "kubectl apply -f examples/k8s-cpu.yaml"]
    positions = [index(p) for p in order]
    assert positions == sorted(positions), "commands out of order"
    load = cmds[index("kind load docker-image")].split()
    assert sorted(load[load.index("seqtrain") + 1:]) == sorted(images)  # exactly what `make images` built
    helm = cmds[index("helm install")]
    assert "image." not in helm  # the chart's defaults are the loaded images
    # the cluster's shared folder, the volume and the job's claim fit together
    cluster = yaml.safe_load((ROOT / "examples" / "kind" / "cluster.yaml").read_text())
    workers = [n for n in cluster["nodes"] if n["role"] == "worker"]
    mounts = {(m["hostPath"], m["containerPath"]) for n in workers for m in n["extraMounts"]}
    assert mounts == {("/tmp/seqtrain-ckpt", "/mnt/seqtrain-ckpt")} and len(workers) == 2
    pv, pvc = yaml.safe_load_all((ROOT / "examples" / "kind" / "checkpoint-volume.yaml").read_text())
    assert pv["spec"]["hostPath"]["path"] == "/mnt/seqtrain-ckpt"
    assert "ReadWriteMany" in pv["spec"]["accessModes"] and pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    job = yaml.safe_load((ROOT / "examples" / "k8s-cpu.yaml").read_text())
    assert job["spec"]["checkpoint"]["pvc"] == pvc["metadata"]["name"]
    assert pvc["metadata"]["namespace"] == job["metadata"].get("namespace", "default")
    assert "image" not in job["spec"]  # the default trainer image, loaded above


@pytest.mark.slow
def test_release_workflow_publishes_the_images_and_the_chart_on_a_version_tag() -> None:
    import yaml

    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yaml").read_text())
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert on["push"]["tags"] == ["v*.*.*"] and "branches" not in on["push"]
    assert wf["permissions"]["packages"] == "write"
    runs = "\n".join(s.get("run", "") for job in wf["jobs"].values() for s in job["steps"])
    assert 'make images IMAGE_REPO="$IMAGE_REPO"' in runs and "make -s print-images" in runs and "docker push" in runs
    assert "helm package charts/seqtrain" in runs and 'helm push "dist/seqtrain-${VERSION}.tgz" "$CHART_REPO"' in runs
    assert wf["env"]["CHART_REPO"].startswith("oci://")
    trainer, _ = _make_images()
    assert trainer.startswith(wf["env"]["IMAGE_REPO"] + "/")  # it pushes the default names
    assert ".github/workflows/release.yaml" in (ROOT / "README.md").read_text()
