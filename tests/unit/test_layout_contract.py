"""Repository contracts from DESIGN.md that are easy to break by accident."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_import_torch_from_repo_root_still_works():
    # `operator/` must never shadow the standard library's `operator` module (torch imports it).
    out = subprocess.run([sys.executable, "-c", "import torch, operator; print(operator.__file__)"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "site-packages" in out.stdout or "lib/python" in out.stdout


def test_source_roots_are_not_packages():
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert not (ROOT / "trainer" / "__init__.py").exists()


@pytest.mark.slow
def test_spec_and_cli_import_without_torch():
    # The operator image has no torch: the spec, planner, controller and CLI must not import it.
    code = (
        "import sys, importlib\n"
        "for m in ['seqtrain.spec', 'seqtrain.spec.crd', 'seqtrain_operator.cli', 'seqtrain_operator.planner']:\n"
        "    importlib.import_module(m)\n"
        "assert 'torch' not in sys.modules, [m for m in sys.modules if m.startswith('torch')][:3]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_ci_calls_readme_test_command():
    assert "make test" in (ROOT / ".ci/run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()
