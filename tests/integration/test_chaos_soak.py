"""A short chaos soak on the real control plane (`seqtrain bench chaos`, docs/benchmarks.md "Chaos soak"): random
faults of every injectable kind over real trainer jobs and admission-only ones, with the invariants of
seqtrain_operator.chaos.invariants checked throughout; the soak must end with none violated.

Two soaks: a fixed seed (the same schedule every run) and a random one, printed so that a failure can be replayed
with `seqtrain bench chaos --seed N --minutes M --rates ...` (the command is in the failure message). Deadlines are
the jobs' own (pending grace, hang timeout, backoff) and the operator's options, not this machine's speed.

The second soak reuses the first one's reference losses (`--reference`: same spec, an uninterrupted run), so both
take about 3 minutes of faults beside one reference job. The soak runs its own operator behind the fault proxy: the session's operator is stopped for it, and started again
(re-installed: the soak's release points the webhook at its own operator) afterwards.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.fixtures import Operator, Testbed

pytestmark = pytest.mark.slow

FIXED_SEED = 41
MINUTES = 1.5
STEPS = 150
# Faults per hour: high, so that a minute and a half meets most kinds (a 3-minute CI budget for both soaks).
RATES = ("sigkill-rank=400,sigstop-rank=120,node-down=60,delete-pod=120,evict-pod=120,operator-kill=60,"
         "operator-restart=60,api-5xx=240,api-429=240,api-slow=120,watch-cut=240,watch-gone=120,"
         "checkpoint-full=60,checkpoint-corrupt=120,sigterm-node-loss=60")


@pytest.fixture
def own_operator(testbed: Testbed, seqtrain_operator: Operator) -> Iterator[None]:
    """The session's operator is off while the soak runs its own; back (with its webhook) afterwards."""
    seqtrain_operator.stop()
    try:
        yield
    finally:
        seqtrain_operator.install()
        seqtrain_operator.start()


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the first soak leaves its reference losses: the second one (same spec) reuses them."""
    return tmp_path_factory.mktemp("chaos-reference")


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("which", ["fixed", "random"])
def test_a_short_soak_violates_no_invariant(own_operator: None, tmp_path: Path, reference_dir: Path,
                                            which: str) -> None:
    from seqtrain_operator.chaos import bench

    seed = FIXED_SEED if which == "fixed" else random.SystemRandom().randrange(2**31)
    argv = ["--seed", str(seed), "--minutes", str(MINUTES), "--load-jobs", "2", "--steps", str(STEPS),
            "--rates", RATES, "--out", str(tmp_path / "chaos.json")]
    reference = reference_dir / "reference.jsonl"
    if reference.exists():
        argv += ["--reference", str(reference)]
    print(f"chaos soak seed {seed}: seqtrain bench chaos {' '.join(argv)}")
    rc = bench.main(argv)
    if (tmp_path / "chaos.reference.jsonl").exists() and not reference.exists():
        shutil.copy(tmp_path / "chaos.reference.jsonl", reference)
    result = json.loads((tmp_path / "chaos.json").read_text())
    replay = f"replay: seqtrain bench chaos {' '.join(argv)} (events: {result.get('events_log')})"
    assert result["violations"] == [], f"{json.dumps(result['violations'], indent=1)}\n{replay}"
    assert rc == 0, replay
    assert result["jobs_run"] >= 1 and result["faults_injected"] >= 1, result
    assert result["jobs_failed"]["unexpected"] == 0 and result["stuck"] == 0, replay
