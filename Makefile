# seqtrain developer entry points. `make demo` and `make test` work on a fresh machine: they install first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
# The slowest tests pytest lists at the end (`make test DURATIONS=0` lists all).
DURATIONS ?= 25
STAMP := $(VENV)/.seqtrain-installed
TORCH_VERSION ?= 2.13.0
MIN_FREE_GIB ?= 10
# Compiled DeepSpeed/Triton ops are cached here so only the first run pays for compiling them.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export TRITON_CACHE_DIR ?= $(CURDIR)/.cache/triton
export OMP_NUM_THREADS ?= 1
export PYTHONUNBUFFERED := 1
# Image names: the chart's default operator image and the spec's default trainer image are exactly these (tested), so
# `make images` + `kind load docker-image` + `helm install` needs no image overrides; the release workflow pushes them.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n 1)
IMAGE_REPO ?= ghcr.io/seqtrain
TRAINER_IMAGE ?= $(IMAGE_REPO)/trainer:$(VERSION)
OPERATOR_IMAGE ?= $(IMAGE_REPO)/operator:$(VERSION)

.PHONY: install demo test test-fast lint crd verify-crd tools chart-test images print-images kind-e2e clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@# A full disk fails pip with "OSError: [Errno 28]" 16 s in (a CI run did): say what is short and what takes it.
	@avail=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); if [ "$${avail:-99}" -lt $(MIN_FREE_GIB) ]; then \
		echo "make install: only $$avail GiB free under $(CURDIR) (df -h .); a fresh install needs about $(MIN_FREE_GIB) GiB" \
		"(the venv with torch's CUDA wheels is about 6 GiB, pip's download of them 3 GiB): free space" \
		"(old clones, /tmp/pytest-of-$$(id -un)) or set VENV to a larger disk" >&2; fi
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	@# On machines without an NVIDIA driver pin torch first, from PyPI (on Linux x86_64 that is the CUDA build, which
	@# runs on the CPU; this project's machines reach PyPI only), else from PyTorch's CPU index: the package's torch
	@# range is then already satisfied and `pip install -e` changes nothing of it.
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q "torch==$(TORCH_VERSION)" \
		|| $(PY) -m pip install -q "torch==$(TORCH_VERSION)" --index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

tools: install
	bash scripts/install-tools.sh

demo: install
	@$(PY) -m compileall -q -j 0 trainer operator >/dev/null
	$(BIN)/seqtrain run examples/quickstart.yaml --workdir runs/quickstart
	@if [ -d runs/quickstart ]; then echo "run folder: runs/quickstart  (report: $(BIN)/seqtrain report runs/quickstart)"; fi

# The whole suite, slow tests included (what CI runs).
# The control-plane binaries (scripts/k8s-binaries.sh) and the gang schedulers (scripts/gang-schedulers.sh), each
# built once per machine, then cached: the first go to the testbed fixtures through SEQTRAIN_K8S_BIN, the tests
# find the others in the cache; under CI=true failing to get them fails the suite, elsewhere those tests skip.
# Under CI=true the images are built too (`make images`, cached by content) for the container-node tests.
test: install tools
	$(BIN)/ruff check .
	@# Under CI=true the images build beside the Go builds (mostly downloads and unpacking against mostly compiling:
	@# on a fresh machine this saves most of the image build's time); its log is printed once it is waited for.
	@# The oldest Kubernetes the chart claims is run where its build is cached; building it here would add 30-45
	@# minutes on 2 cores, more than a cold CI run's 90-minute budget leaves: `scripts/k8s-binaries.sh --oldest`.
	@if [ "$${CI:-}" = true ]; then mkdir -p .cache; $(MAKE) -s images >.cache/images.log 2>&1 & images=$$!; fi; \
	bin=$$(scripts/k8s-binaries.sh) || { \
		if [ "$${CI:-}" = true ]; then echo "make test: scripts/k8s-binaries.sh failed (CI=true: no skipping)" >&2; exit 1; fi; \
		echo "make test: no control-plane binaries; the testbed tests will skip" >&2; bin=; }; \
	old=$$(scripts/k8s-binaries.sh --oldest --check) || { \
		echo "make test: the oldest claimed Kubernetes is not built on this machine (scripts/k8s-binaries.sh --oldest); its test skips" >&2; old=; }; \
	scripts/gang-schedulers.sh >/dev/null || { \
		if [ "$${CI:-}" = true ]; then echo "make test: scripts/gang-schedulers.sh failed (CI=true: no skipping)" >&2; exit 1; fi; \
		echo "make test: no gang schedulers; their tests will skip" >&2; }; \
	if [ "$${CI:-}" = true ]; then \
		rc=0; wait $$images || rc=$$?; cat .cache/images.log; \
		[ $$rc = 0 ] || { echo "make test: make images failed (CI=true: the container tests need them)" >&2; exit 1; }; \
	else echo "make test: the container-node tests use the images of a previous \`make images\` (else they skip)" >&2; fi; \
	$(PY) -m compileall -q -j 0 trainer operator tests >/dev/null; \
	SEQTRAIN_K8S_BIN="$$bin" SEQTRAIN_K8S_OLDEST_BIN="$$old" PATH="$(CURDIR)/$(BIN):$(CURDIR)/.tools/bin:$$PATH" scripts/test-halves.sh $(PY) -q --durations=$(DURATIONS) tests

# The project's own bytecode, written once: where PYTHONDONTWRITEBYTECODE=1 is set (CI shells, this VM's) every
# process (each rank of each test) would otherwise compile the ~300 modules it imports again, 1-2 s a process.
test-fast: install
	$(PY) -m compileall -q -j 0 trainer operator tests >/dev/null
	$(PY) -m pytest -q -m "not slow" tests

lint: install
	$(BIN)/ruff check .

crd: install
	$(BIN)/seqtrain crd > crds/seqtrainjob.yaml
	cp crds/seqtrainjob.yaml charts/seqtrain/crds/seqtrainjob.yaml
	$(PY) -m seqtrain.spec.reference > docs/spec-reference.md

verify-crd: install
	$(BIN)/seqtrain crd | diff -u crds/seqtrainjob.yaml -
	diff -u crds/seqtrainjob.yaml charts/seqtrain/crds/seqtrainjob.yaml

chart-test: tools
	$(PY) -m pytest -q tests/unit/test_chart.py

# docker build where a Docker engine answers, else buildah (+ a local Debian base where no registry is reachable);
# cached by the content of the inputs: a second run with nothing changed builds nothing (scripts/images.sh).
images:
	bash scripts/images.sh $(TRAINER_IMAGE) $(OPERATOR_IMAGE)

print-images:
	@echo $(TRAINER_IMAGE) $(OPERATOR_IMAGE)

kind-e2e:
	bash tests/e2e/kind-e2e.sh

clean:
	rm -rf runs .pytest_cache .ruff_cache build *.egg-info
