"""The collective watchdog: a wait that outlives its deadline logs the label and exits with code 4."""

from __future__ import annotations

import subprocess
import sys

import pytest

from seqtrain.parallel import watchdog

HANG = """
import time
from seqtrain.parallel import watchdog
watchdog.start(timeout_s=0.5, rank=3, grace_s=0.5)
with watchdog.waiting("step 7: gradient all-reduce over dp ranks [2, 3]"):
    time.sleep(60)
"""


@pytest.mark.slow
def test_hung_wait_exits_4_naming_what_it_waited_for() -> None:
    p = subprocess.run([sys.executable, "-c", HANG], capture_output=True, text=True, timeout=30)
    assert p.returncode == 4
    assert "rank 3: collective timeout" in p.stderr
    assert "step 7: gradient all-reduce over dp ranks [2, 3]" in p.stderr


def test_current_label_is_cleared_after_the_wait() -> None:
    with watchdog.waiting("earlier wait"):  # a clean wait forgets what an earlier test's failed wait left behind
        pass
    assert watchdog.current() is None
    with watchdog.waiting("barrier"):
        assert watchdog.current() == "barrier"
    assert watchdog.current() is None


def test_label_survives_the_exception_it_ended_with() -> None:
    try:
        with watchdog.waiting("step 3: all-reduce"):
            raise TimeoutError("gloo timed out")
    except TimeoutError:
        assert watchdog.current() == "step 3: all-reduce"
    with watchdog.waiting("next"):
        pass
    assert watchdog.current() is None
