#!/usr/bin/env bash
# Runs `seqtrain bench gpu --out OUT` on the lent GPU machine, in the repository root, with that machine's
# python3: installs the wheels of .whl/ (scripts/device-wheels.sh, carried) into a private target folder,
# puts it and the source tree on PYTHONPATH (nothing is installed into the machine's own Python), and shares
# one inductor and Triton cache between the benchmark's parts so each kernel compiles once.
# Exit 0 when every part ran; the bench's own exit code otherwise. Without CUDA this is the dry run
# (scripts/gpu-mirror.sh rehearses it here).
#
#   scripts/device-bench.sh OUT [extra `seqtrain bench gpu` options]
set -euo pipefail

OUT=${1:?usage: scripts/device-bench.sh OUT [seqtrain bench gpu options]}
shift
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${SEQTRAIN_DEVICE_SITE:-/tmp/seqtrain-device-site}
CACHE=${SEQTRAIN_DEVICE_CACHE:-/tmp/seqtrain-device-cache}

if compgen -G '.whl/*.whl' >/dev/null; then
    rm -rf "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
else
    echo "device-bench: no .whl/ here (run scripts/device-wheels.sh and carry .whl): using $PY's own packages" >&2
fi
export PYTHONPATH="$PWD/trainer:$PWD/operator${SITE:+:$SITE}"
export PYTHONUNBUFFERED=1
# One cache for every part (each runs in its own process): warmed once, by the first part that compiles.
export TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor" TRITON_CACHE_DIR="$CACHE/triton"
mkdir -p "$OUT" "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"
"$PY" -c 'import sys, torch; print(f"device-bench: python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"cuda {torch.cuda.is_available()}", file=sys.stderr)'
exec "$PY" -m seqtrain_operator.cli bench gpu --out "$OUT" "$@"
