"""What a rank's start-up does not pay for: the cyclic collector's scans of its lifelong imports
(seqtrain.train.entry.lifelong_imports), and the CLI's version lookup (every `seqtrain train` builds the parser)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from seqtrain.train.entry import lifelong_imports


def test_lifelong_imports_run_without_the_collector_and_freeze_what_they_made() -> None:
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with pytest.raises(RuntimeError), lifelong_imports():
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]  # lists are tracked by the collector
            raise RuntimeError("an import failed")
        assert gc.isenabled()  # also after a failure inside
        assert gc.get_freeze_count() >= frozen + len(made)
    finally:
        gc.unfreeze()  # this test process's objects go back to the collector


@pytest.mark.slow  # starts a fresh interpreter: this one has imported everything already
def test_building_the_cli_parser_does_not_look_up_the_version() -> None:
    code = ("import sys, seqtrain_operator.cli as cli; cli.build_parser(); "
            "print('importlib.metadata' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr
