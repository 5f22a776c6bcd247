#!/usr/bin/env bash
# Writes into .whl/ (git-ignored) the wheels that the lent GPU machine lacks for `seqtrain bench gpu`: it has
# Python 3.12, torch 2.11, triton, numpy, pyyaml, pytest and typing-extensions (the device tool's KINDS.md)
# but no pydantic, and it reaches no package index. Run here, in the repository root; the device call then
# names `.whl` in `carry` and scripts/device-bench.sh installs them there (docs/benchmarks.md, "GPU lease").
#
# What travels and why (one version of each: two of one name stop the install):
#   pydantic, pydantic-core, annotated-types, typing-inspection  the spec models (seqtrain.spec) need them
#   typing-extensions   pydantic-core needs a newer one than an image may hold; tiny, so always carried
# What does not: kopf, kubernetes (operator only: the bench and the GPU test files import neither);
# deepspeed (ZeRO is not part of `seqtrain bench gpu`; PyPI has only its source distribution, whose install
# compiles or probes CUDA ops, and it would pull hjson, ninja, py-cpuinfo, msgpack, psutil: a ZeRO lease is
# a run of its own, with a wheel built for it).
#
#   scripts/device-wheels.sh          # prints the wheels and their total size; exit 1 over 40 MiB
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] && PYTHON=${PYTHON_FOR_PIP:-.venv/bin/python}
LIMIT_MIB=40
# The versions the test suite runs with (pyproject's ranges admit them).
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0)

rm -rf .whl
mkdir -p .whl
grep -qx '/.whl/' .gitignore 2>/dev/null || echo '/.whl/' >>.git/info/exclude 2>/dev/null || true
# --platform: pip matches the manylinux tag exactly, so name the ones these wheels are built for.
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl "${WHEELS[@]}"
count=$(find .whl -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
    echo "device-wheels: expected ${#WHEELS[@]} wheels in .whl/, found $count" >&2
    exit 1
fi
bytes=$(du -cb .whl/*.whl | tail -1 | cut -f1)
ls -1 .whl
echo "device-wheels: $count wheels, $((bytes / 1024)) KiB in .whl/ (limit ${LIMIT_MIB} MiB)"
if [ "$bytes" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
    echo "device-wheels: .whl/ is over ${LIMIT_MIB} MiB: carry fewer wheels" >&2
    exit 1
fi
