#!/usr/bin/env bash
# Rehearses a GPU lease on this machine: builds a virtual environment that mirrors the lent GPU machine's
# Python (see the device tool's KINDS.md: Python 3.12, torch 2.11.0, triton 3.6.0 and the few packages of its
# image that the GPU benchmark touches; no pydantic, kopf, kubernetes or deepspeed, nothing of ours), then runs
# what a lease runs: scripts/device-wheels.sh here, and scripts/device-bench.sh OUT with that environment's
# python3 first on PATH. Without CUDA, device-bench.sh is the dry run, so this proves that the lease's command
# gets past imports, collection and every part before any GPU time is spent. Its kernels part runs on Triton's
# interpreter, which `seqtrain bench kernels` patches for numpy 2.5 (the lent machine's numpy; there the GPU
# compiles the kernels and the interpreter never runs): docs/benchmarks.md says what and why.
#
#   scripts/gpu-mirror.sh [OUT [BENCH OPTIONS]]   # OUT defaults to /tmp/seqtrain-gpu-mirror-out; prints summary.json
#
# Every part runs, the profile included (`--profile`); BENCH OPTIONS are added to `seqtrain bench gpu`'s, e.g.
# `--parts mfu,profile,training` to rehearse one call of the lease plan (docs/benchmarks.md).
#
# The environment is cached outside the clone (only the first run downloads it). torch is 2.11.0's CPU build from
# PyTorch's CPU index (about 200 MB) where that index answers, else PyPI's CUDA build (a few GB): without a GPU here
# both run the same Python code, and the dry run never loads CUDA's libraries. SEQTRAIN_GPU_MIRROR overrides where;
# SEQTRAIN_GPU_MIRROR_PYTHON the interpreter (default: pyenv's 3.12.1); SEQTRAIN_GPU_MIRROR_TORCH_INDEX where torch
# comes from (https://pypi.org/simple: the CUDA build, where PyTorch's index is out of reach).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-/tmp/seqtrain-gpu-mirror-out}
shift $(( $# > 0 ? 1 : 0 ))
[ $# -gt 0 ] || set -- --profile  # every part by default
VENV=${SEQTRAIN_GPU_MIRROR:-${XDG_CACHE_HOME:-$HOME/.cache}/seqtrain/gpu-mirror-py312-torch2.11.0-cpu}
PY=${SEQTRAIN_GPU_MIRROR_PYTHON:-$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")/versions/3.12.1/bin/python3}
# The lent image's versions where KINDS.md gives them (its pip list: torch 2.11.0, triton 3.6.0, numpy 2.5.2);
# the rest are packages its image holds (any version).
# torch pulls its own needs (filelock, fsspec, jinja2, networkx, sympy, typing-extensions, nvidia-*), all
# of which the image holds too.
TORCH=torch==2.11.0
TORCH_INDEX=${SEQTRAIN_GPU_MIRROR_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
PACKAGES=(triton==3.6.0 numpy==2.5.2 pyyaml packaging pytest pytest-timeout pytest-xdist)

[ -x "$PY" ] || { echo "gpu-mirror: no Python 3.12 at $PY (set SEQTRAIN_GPU_MIRROR_PYTHON)" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if [ "$(cat "$VENV/.complete" 2>/dev/null)" != "$TORCH ${PACKAGES[*]}" ]; then
    # --no-cache-dir: the wheels need not stay twice on a shared disk. PIP_FIND_LINKS is ignored: the mirror
    # takes what the lent image was built from (PyTorch's and PyPI's wheels), not this machine's local wheels.
    # PyTorch's CPU index first (small); where it is out of reach (this project's machines reach PyPI only), PyPI's
    # CUDA build, which runs the same Python code on a machine without a GPU.
    PIP_FIND_LINKS='' "$VENV/bin/python" -m pip install -q --no-cache-dir --timeout 20 --retries 1 \
            --index-url "$TORCH_INDEX" "$TORCH" \
        || { [ "$TORCH_INDEX" != https://pypi.org/simple ] \
             && echo "gpu-mirror: $TORCH not installable from $TORCH_INDEX; taking PyPI's (CUDA) build" >&2 \
             && PIP_FIND_LINKS='' "$VENV/bin/python" -m pip install -q --no-cache-dir "$TORCH"; } || {
        echo "gpu-mirror: $TORCH installable neither from $TORCH_INDEX nor from PyPI; set SEQTRAIN_GPU_MIRROR_TORCH_INDEX" >&2
        exit 2
    }
    PIP_FIND_LINKS='' "$VENV/bin/python" -m pip install -q --no-cache-dir "${PACKAGES[@]}"
    echo "$TORCH ${PACKAGES[*]}" >"$VENV/.complete"  # a changed list is installed again
fi
"$VENV/bin/python" - <<'EOF'
import importlib.util, sys, torch, triton
absent = [m for m in ("pydantic", "kopf", "kubernetes", "deepspeed", "seqtrain") if importlib.util.find_spec(m)]
assert not absent, f"the mirror must not hold {absent}: the lent machine has none of them"
print(f"gpu-mirror: python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
      f"cuda {torch.cuda.is_available()}")
EOF

cd "$ROOT"
scripts/device-wheels.sh
rm -rf "$OUT"
# The lent machine runs `python3` from a clean environment: only the mirror's bin first on PATH, nothing of
# this checkout's .venv, and no PYTHONPATH but the one device-bench.sh sets.
env -u PYTHONPATH -u VIRTUAL_ENV PATH="$VENV/bin:/usr/bin:/bin" SEQTRAIN_DEVICE_SITE=/tmp/seqtrain-gpu-mirror-site \
    scripts/device-bench.sh "$OUT" "$@"
