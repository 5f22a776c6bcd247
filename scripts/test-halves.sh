#!/usr/bin/env bash
# `make test`'s pytest in two processes (docs/development.md, "How long `make test` takes"): the tests on a control
# plane (marker `control_plane`, added by tests/conftest.py) in one, in order, since they share the testbed and its
# operator; every other test in a second process beside it, whose report follows the first's. Most of the first
# half's time is spent waiting on controllers, kubelets and timers, which leaves the CPU to the second.
#   scripts/test-halves.sh PYTHON [PYTEST ARGS...]   (SEQTRAIN_TEST_HALVES=0: one process, as before)
set -uo pipefail
py=$1; shift
if [ "${SEQTRAIN_TEST_HALVES:-1}" = 0 ]; then exec "$py" -m pytest "$@"; fi
prof=${SEQTRAIN_TEST_PROFILE:-}  # one profile per half: FILE.control-plane and FILE.rest
log=$(mktemp "${TMPDIR:-/tmp}/seqtrain-pytest-rest.XXXXXX")
SEQTRAIN_TEST_PROFILE=${prof:+$prof.rest} "$py" -m pytest -m "not control_plane" "$@" >"$log" 2>&1 &
rest=$!
# Ctrl-C or a killed make stops both halves (pytest tears its session fixtures down on SIGINT).
trap 'kill -INT $rest 2>/dev/null; wait $rest; rm -f "$log"; exit 130' INT TERM
SEQTRAIN_TEST_PROFILE=${prof:+$prof.control-plane} "$py" -m pytest -m control_plane "$@"
first=$?
wait $rest
second=$?
trap - INT TERM
echo
echo "==================== the tests off the control plane (run beside the ones above) ===================="
cat "$log"
rm -f "$log"
echo "make test: control-plane half exit $first, the other half exit $second"
[ "$first" = 0 ] && [ "$second" = 0 ]
