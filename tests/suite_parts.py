"""How `make test` shares the control-plane modules among its shards (scripts/test-halves.sh, tests/conftest.py).

Whole modules, since a module's tests share fixtures; longest first, each to the shard with the least time so far, by
CP_SECONDS: each module's pytest time with nothing else running (2026-11-29, this project's 2-core VM, `pytest
--durations=0 -m control_plane`); a module not listed counts 30 s.
"""

from __future__ import annotations

from pathlib import Path

CP_SECONDS = {"test_chaos_soak.py": 377, "test_gang_schedulers.py": 237, "test_operator_real.py": 156,
              "test_operator_resilience.py": 143, "test_operator.py": 112, "test_containers.py": 96,
              "test_client_real.py": 94, "test_testbed_inplace_restart.py": 89, "test_testbed_e2e.py": 87,
              "test_elastic_gang.py": 85, "test_progress_push_real.py": 83, "test_operator_ha.py": 55,
              "test_checkpoint_policy_real.py": 54, "test_testbed_rank_crash.py": 42,
              "test_testbed_sigterm_save.py": 36, "test_sidecars.py": 18, "test_operator_paths.py": 15,
              "test_gang_crds.py": 13, "test_lost_time_testbed.py": 12}


def shard_of(value: str) -> tuple[int, int] | None:
    """SEQTRAIN_CP_SHARD's "K/N" as (K, N); None when it is not of that form with 1 <= K <= N."""
    ks, _, ns = value.partition("/")
    if not (ks.isdigit() and ns.isdigit() and 1 <= int(ks) <= int(ns)):
        return None
    return int(ks), int(ns)


def cp_shards(modules: list[str], n: int) -> list[list[str]]:
    """`modules` in `n` shards of about equal time (greedy, longest first; ties to the lower shard)."""
    shards: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for name in sorted(modules, key=lambda m: (-CP_SECONDS.get(Path(m).name, 30), m)):
        k = load.index(min(load))
        shards[k].append(name)
        load[k] += CP_SECONDS.get(Path(name).name, 30)
    return shards
