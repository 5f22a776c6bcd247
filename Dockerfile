# syntax=docker/dockerfile:1.7
# Two images from one file:
#   docker build --target trainer  -t seqtrain/trainer:dev .    # torch, deepspeed, triton; CPU by default
#   docker build --target operator -t seqtrain/operator:dev .   # slim: spec, planner, controller, kopf; no torch
# GPU trainer: pick a CUDA base and the matching torch wheel index, e.g.
#   docker build --target trainer \
#     --build-arg TRAINER_BASE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 -t seqtrain/trainer:cuda .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TRAINER_BASE=${PYTHON_IMAGE}

# ---- build the seqtrain wheel once; both images install it ------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder
WORKDIR /src
RUN pip install --no-cache-dir --upgrade pip setuptools wheel
COPY pyproject.toml README.md ./
COPY trainer ./trainer
COPY operator ./operator
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- operator: the control plane, no torch ----------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 SEQTRAIN_CHECK_PATHS=0
COPY --from=builder /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/seqtrain-*.whl)[operator]" \
    && rm -rf /wheels \
    && useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin seqtrain
USER 1000:1000
ENTRYPOINT ["seqtrain", "operator"]

# ---- trainer: every rank of a gang runs this ---------------------------------------------------------------------
FROM ${TRAINER_BASE} AS trainer
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    HOME=/tmp TRITON_CACHE_DIR=/tmp/triton TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
# CUDA bases ship no Python; the default python image does.
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv \
    && pip install --no-cache-dir --upgrade pip
# torch first, from the index that matches the base (CPU wheels by default), so the extra below never pulls CUDA.
# pip's downloads stay in a build cache mount, never in the image (HOME is /tmp here: pip's default cache would be
# /tmp/.cache/pip, inside the layer): a rebuild after a source change downloads nothing.
RUN --mount=type=cache,id=seqtrain-pip,target=/var/cache/pip \
    PIP_CACHE_DIR=/var/cache/pip pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
COPY --from=builder /wheels /wheels
RUN --mount=type=cache,id=seqtrain-pip,target=/var/cache/pip \
    PIP_CACHE_DIR=/var/cache/pip pip install "$(ls /wheels/seqtrain-*.whl)[train]" \
    && rm -rf /wheels \
    && (id -u 1000 >/dev/null 2>&1 || useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin seqtrain)
USER 1000:1000
WORKDIR /tmp
ENTRYPOINT ["seqtrain", "train"]
