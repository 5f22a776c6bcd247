"""Suite-wide settings: every test process (and the rank processes it starts) shares these."""

from __future__ import annotations

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Small thread pools: the suite runs on 2 cores with several rank processes at a time.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# Compiled DeepSpeed / Triton artefacts are cached across tests (and across runs in the same checkout).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
os.environ.setdefault("TRITON_CACHE_DIR", str(ROOT / ".cache" / "triton"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Triton kernels run on the CPU through Triton's interpreter, which must be switched on before triton is first
# imported (torch imports it lazily, e.g. when an optimizer is built): once imported without it, the interpreter
# fails with "Cannot call @triton.jit'd outside of the scope of a kernel". Models keep the PyTorch reference on the
# CPU unless a test asks for kernels, so this only changes the tests that do.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Rank processes import the packages from the source roots, installed or not.
_pp = [str(ROOT / "trainer"), str(ROOT / "operator")]
os.environ["PYTHONPATH"] = os.pathsep.join(_pp + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

# Fuzz tests (marker `fuzz`) draw their example counts from one hypothesis profile: "ci" keeps `make test` within a
# few minutes; SEQTRAIN_FUZZ=long runs the longer mode documented for before a release (docs/development.md).
try:
    from hypothesis import HealthCheck
    from hypothesis import settings as _hsettings

    _hsettings.register_profile(
        "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False
    )
    _hsettings.register_profile(
        "long", max_examples=20000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    _hsettings.load_profile("long" if os.environ.get("SEQTRAIN_FUZZ") == "long" else "ci")
except ImportError:  # hypothesis is a dev dependency; a bare install still collects the other tests
    pass
