"""How `make test` splits the suite (scripts/test-halves.sh, tests/conftest.py): every control-plane module in exactly
one shard, each shard on a testbed of its own, and the suite red when any part is red."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from suite_parts import CP_SECONDS, cp_shards

ROOT = Path(__file__).resolve().parents[2]


def test_every_module_is_in_exactly_one_shard_and_the_shards_are_balanced() -> None:
    modules = [f"tests/integration/{m}" for m in CP_SECONDS] + ["tests/e2e/test_new_one.py"]
    for n in (1, 2, 3):
        shards = cp_shards(modules, n)
        assert sorted(m for s in shards for m in s) == sorted(modules)
        assert cp_shards(list(reversed(modules)), n) == shards  # the order given does not matter
        loads = [sum(CP_SECONDS.get(Path(m).name, 30) for m in s) for s in shards]
        assert max(loads) - min(loads) <= max(CP_SECONDS.values()), loads
    first, second = cp_shards(modules, 2)
    assert ("tests/integration/test_chaos_soak.py" in first) != ("tests/integration/test_chaos_soak.py" in second)


FAKE_PYTEST = """#!/usr/bin/env bash
# stands in for `python -m pytest ...`: says which part it is, exits as told
shift 2
echo "part marker=$2 shard=${SEQTRAIN_CP_SHARD:-none} testbed=$TESTBED_DIR"
case "$2/${SEQTRAIN_CP_SHARD:-none}" in
  "$FAIL") exit 1 ;;
esac
exit 0
"""


def run_parts(tmp_path: Path, shards: str, fail: str) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTEST)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "SEQTRAIN_CP_SHARDS": shards, "FAIL": fail, "TESTBED_DIR": str(tmp_path / "tb"),
           "TMPDIR": str(tmp_path)}
    env.pop("SEQTRAIN_TEST_HALVES", None)
    return subprocess.run(["bash", str(ROOT / "scripts" / "test-halves.sh"), str(fake), "-q", "tests"],
                          capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("fail", ["none", "control_plane/1/3", "control_plane/3/3", "not control_plane/none"])
def test_the_parts_run_on_testbeds_of_their_own_and_any_red_part_makes_the_suite_red(tmp_path: Path,
                                                                                    fail: str) -> None:
    out = run_parts(tmp_path, "3", fail)
    parts = sorted(line for line in out.stdout.splitlines() if line.startswith("part "))
    tb = tmp_path / "tb"
    assert parts == [f"part marker=control_plane shard=1/3 testbed={tb}",
                     f"part marker=control_plane shard=2/3 testbed={tb}-2",
                     f"part marker=control_plane shard=3/3 testbed={tb}-3",
                     f"part marker=not control_plane shard=none testbed={tb}"], out.stdout
    assert out.returncode == (0 if fail == "none" else 1), out.stdout + out.stderr
    assert list(tmp_path.glob("seqtrain-pytest-*")) == []  # the parts' logs are removed


@pytest.mark.slow
def test_one_shard_runs_every_control_plane_test_on_the_one_testbed(tmp_path: Path) -> None:
    out = run_parts(tmp_path, "1", "none")
    parts = sorted(line for line in out.stdout.splitlines() if line.startswith("part "))
    tb = tmp_path / "tb"
    assert parts == [f"part marker=control_plane shard=none testbed={tb}",
                     f"part marker=not control_plane shard=none testbed={tb}"], out.stdout
    assert out.returncode == 0


def test_each_shard_picks_rendezvous_ports_from_a_slice_of_its_own() -> None:
    from testbed.fixtures import rendezvous_band

    assert rendezvous_band("") == (2000, 0) and rendezvous_band("x/y") == (2000, 0)
    for n in (1, 2, 3):
        slices = [rendezvous_band(f"{k}/{n}") for k in range(1, n + 1)]
        assert slices[0][0] == 2000 and slices[-1][1] == 0
        assert all(a > b for a, b in slices)  # free_port's band (a, b): from low-a up to low-b
        assert all(slices[i][1] == slices[i + 1][0] for i in range(n - 1))  # adjacent, not overlapping


class _Kubectl:
    """A Testbed's `kubectl` that lists two jobs and records what it was asked to delete."""

    def __init__(self) -> None:
        self.deleted: list[tuple[str, ...]] = []

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        import json

        if args[0] == "delete":
            self.deleted.append(args)
            return subprocess.CompletedProcess(args, 0, "", "")
        items = [{"metadata": {"name": name, "namespace": "ns", "creationTimestamp": ts}}
                 for name, ts in (("old", "2026-11-29T05:59:59Z"), ("same", "2026-11-29T06:00:00Z"),
                                 ("new", "2026-11-29T06:00:01Z"))]
        return subprocess.CompletedProcess(args, 0, json.dumps({"items": items}), "")


def test_a_failed_tests_jobs_are_deleted_and_earlier_ones_kept() -> None:
    from datetime import datetime

    from testbed.fixtures import delete_jobs_since

    tb = _Kubectl()
    # The test started at 06:00:00.6; "same" was created later in that second (the apiserver's stamp drops the
    # fraction), so it is the test's too.
    since = datetime.fromisoformat("2026-11-29T06:00:00.600+00:00").timestamp()
    assert delete_jobs_since(tb, since) == ["ns/same", "ns/new"]  # type: ignore[arg-type]
    assert [d[2] for d in tb.deleted] == ["same", "new"]
