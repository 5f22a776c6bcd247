#!/usr/bin/env bash
# `make test`'s pytest in several processes (docs/development.md, "How long `make test` takes"): the tests on a
# control plane (marker `control_plane`, added by tests/conftest.py) in SEQTRAIN_CP_SHARDS processes (default 2),
# each on a testbed of its own (TESTBED_DIR: .testbed, .testbed-2, ...) and with whole modules of its shard
# (SEQTRAIN_CP_SHARD=K/N, tests/conftest.py), in order, since a shard's tests share its testbed and operator; every
# other test in one more process beside them. The first shard's report is printed as it runs, the others' after it.
# Most of the control-plane tests' time is spent waiting on controllers, kubelets and timers, which leaves the CPU to
# the rest.
#   scripts/test-halves.sh PYTHON [PYTEST ARGS...]   (SEQTRAIN_TEST_HALVES=0: one process, as before)
set -uo pipefail
py=$1; shift
if [ "${SEQTRAIN_TEST_HALVES:-1}" = 0 ]; then exec "$py" -m pytest "$@"; fi
root=$(cd "$(dirname "$0")/.." && pwd)
shards=${SEQTRAIN_CP_SHARDS:-2}
prof=${SEQTRAIN_TEST_PROFILE:-}  # one profile per process: FILE.control-plane-K and FILE.rest
tb=${TESTBED_DIR:-$root/.testbed}
logs=() pids=()
started() { logs+=("$1"); pids+=("$2"); }
log=$(mktemp "${TMPDIR:-/tmp}/seqtrain-pytest-rest.XXXXXX")
SEQTRAIN_TEST_PROFILE=${prof:+$prof.rest} "$py" -m pytest -m "not control_plane" "$@" >"$log" 2>&1 &
started "$log" $!
for ((k = 2; k <= shards; k++)); do
    log=$(mktemp "${TMPDIR:-/tmp}/seqtrain-pytest-cp$k.XXXXXX")
    TESTBED_DIR=$tb-$k SEQTRAIN_CP_SHARD=$k/$shards SEQTRAIN_TEST_PROFILE=${prof:+$prof.control-plane-$k} \
        "$py" -m pytest -m control_plane "$@" >"$log" 2>&1 &
    started "$log" $!
done
# Ctrl-C or a killed make stops every process (pytest tears its session fixtures down on SIGINT).
trap 'kill -INT "${pids[@]}" 2>/dev/null; wait "${pids[@]}"; rm -f "${logs[@]}"; exit 130' INT TERM
shard=()
if [ "$shards" -gt 1 ]; then shard=(env SEQTRAIN_CP_SHARD="1/$shards"); fi
TESTBED_DIR=$tb SEQTRAIN_TEST_PROFILE=${prof:+$prof.control-plane-1} "${shard[@]}" "$py" -m pytest -m control_plane "$@"
codes=($?)
for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    codes+=($?)
done
trap - INT TERM
names=("the tests off the control plane")
for ((k = 2; k <= shards; k++)); do names+=("the control-plane tests of shard $k/$shards"); done
for ((k = shards; k >= 2; k--)); do  # the other shards first, the rest last (as before)
    i=$((k - 1))
    echo; echo "==================== ${names[$i]} (run beside the ones above) ===================="
    cat "${logs[$i]}"
done
echo; echo "==================== ${names[0]} (run beside the ones above) ===================="
cat "${logs[0]}"
rm -f "${logs[@]}"
echo "make test: exit codes: control-plane shard 1 ${codes[0]}$(for ((k = 2; k <= shards; k++)); do
    printf ', shard %s %s' "$k" "${codes[$k]}"; done), the other tests ${codes[1]}"
for c in "${codes[@]}"; do [ "$c" = 0 ] || exit 1; done
