"""`seqtrain submit` gives the memory verdict of `validate`, `plan` and `run` (seqtrain.spec.memory.memory_problems)
before anything is sent to the cluster: the same line and exit code as `seqtrain run`, `microBatchSize: auto`
judged at the size the estimate chooses."""

from __future__ import annotations

from pathlib import Path

import pytest

from seqtrain.spec import load_job_file
from seqtrain.spec.memory import estimate, replica_need
from seqtrain_operator import client as client_pkg
from seqtrain_operator.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "k8s-cpu.yaml"  # resources.memory 1Gi, microBatchSize 4
MEMORY_LINE = f"{EXAMPLE}: spec.resources.memory: the estimate needs "
NO_CLUSTER = "no kubeconfig at /nonexistent/kubeconfig"


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """No cluster to reach; returns the Client constructions submit attempted (each would be an API call)."""
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    made: list[tuple] = []
    real = client_pkg.Client

    class Recording(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            made.append((args, kwargs))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(client_pkg, "Client", Recording)
    return made


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("micro", ["4", "auto"])
def test_submit_refuses_a_job_over_its_memory_with_runs_line_and_code(
        micro: str, no_cluster: list[tuple], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sets = ["--set", "resources.memory=300Mi", "--set", f"training.microBatchSize={micro}"]
    rc, err = cli(capsys, "submit", str(EXAMPLE), *sets)
    assert no_cluster == [], "submit built a cluster client for a job its memory verdict refuses"
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith(MEMORY_LINE), err
    assert "kubeconfig" not in err
    run_rc, run_err = cli(capsys, "run", str(EXAMPLE), *sets, "--workdir", str(tmp_path / "run"))
    assert (rc, err) == (run_rc, run_err)
    assert not (tmp_path / "run").exists()  # run refused it before writing anything, as submit did


def test_submit_judges_auto_at_the_size_the_estimate_chooses(no_cluster: list[tuple],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # a limit between the need at microBatchSize 4 and at the smallest size: 4 is refused, auto picks one that fits
    fixed = load_job_file(str(EXAMPLE), [])
    smallest = load_job_file(str(EXAMPLE), ["training.microBatchSize=1"])
    limit_mib = int(replica_need(fixed, estimate(fixed)) // 2**20)
    assert replica_need(smallest, estimate(smallest)) <= limit_mib * 2**20 < replica_need(fixed, estimate(fixed))
    memory = f"resources.memory={limit_mib}Mi"
    rc, err = cli(capsys, "submit", str(EXAMPLE), "--set", memory)
    assert rc == 2 and err.startswith(MEMORY_LINE) and no_cluster == []
    rc, err = cli(capsys, "submit", str(EXAMPLE), "--set", memory, "--set", "training.microBatchSize=auto")
    assert rc == 1 and NO_CLUSTER in err and "spec.resources.memory" not in err, err
    assert len(no_cluster) == 1  # past the verdict, submit went on to the cluster


def test_a_job_that_fits_is_not_refused_by_the_memory_verdict(no_cluster: list[tuple],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = cli(capsys, "submit", str(EXAMPLE))
    assert rc == 1 and NO_CLUSTER in err and "spec.resources.memory" not in err, err
    assert len(no_cluster) == 1
