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
    bench = re.search(r"`seqtrain bench ([\w\\|]+)`", table)
    assert bench, "README lists the benchmarks"
    names = set(bench.group(1).replace("\\", "").split("|"))
    choices = next(a for a in sub.choices["bench"]._actions if a.dest == "name").choices
    assert names == set(choices), f"README's benchmarks {sorted(names)} != seqtrain bench's {sorted(choices)}"
