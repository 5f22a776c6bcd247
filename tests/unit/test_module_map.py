"""docs/architecture.md opens with a map of the Kubernetes backend, one line per module: every module of
operator/seqtrain_operator/k8s appears there exactly once, and the map names no module that is gone."""

from __future__ import annotations

import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "operator" / "seqtrain_operator" / "k8s"
SECTION = "## The Kubernetes backend, module by module"


def mapped(text: str) -> list[str]:
    """The modules the map's lines name (`- `k8s/<path>.py`: ...`), in order, repeats kept."""
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    body = text[start:end if end >= 0 else len(text)]
    return re.findall(r"^- `(k8s/[\w/]+\.py)`:", body, flags=re.M)


def modules() -> set[str]:
    return {f"k8s/{p.relative_to(K8S).as_posix()}" for p in K8S.rglob("*.py")
            if p.name != "__init__.py" and "__pycache__" not in p.parts}


def test_the_architecture_map_names_every_k8s_module_once_and_nothing_else() -> None:
    names = mapped((ROOT / "docs" / "architecture.md").read_text())
    repeated = sorted(n for n, c in collections.Counter(names).items() if c > 1)
    assert not repeated, f"docs/architecture.md names these modules more than once: {repeated}"
    missing, stale = sorted(modules() - set(names)), sorted(set(names) - modules())
    assert not missing, f"add a line for each to docs/architecture.md ({SECTION!r}): {missing}"
    assert not stale, f"docs/architecture.md names modules that are gone (remove or rename the lines): {stale}"


def test_the_map_reader_sees_repeats_and_ends_at_the_next_section() -> None:
    text = f"{SECTION}\n\n- `k8s/a.py`: one\n- `k8s/gangs/b.py`: two\n- `k8s/a.py`: again\n\n## Next\n- `k8s/c.py`: x\n"
    assert mapped(text) == ["k8s/a.py", "k8s/gangs/b.py", "k8s/a.py"]
