#!/usr/bin/env bash
# `make images`: the trainer and operator images of the Dockerfile, named as `make print-images` says.
#
#   scripts/images.sh TRAINER_IMAGE OPERATOR_IMAGE
#
# - A Docker engine that answers: `docker build` (BuildKit), nothing else.
# - Otherwise a daemonless build with buildah (Debian's package; installed here with apt-get when missing and this
#   runs as root) into the containers-storage that podman reads, so `podman run` and the testbed's container
#   nodes (scripts/testbed.sh up --containers) see the images without a registry.
# - Where the Dockerfile's default base (python:3.11-slim-bookworm) cannot be pulled (no registry reachable), a
#   local base with the same Python is built first from this machine's own apt sources with mmdebstrap (bookworm's
#   python3 is 3.11) and passed through the Dockerfile's PYTHON_IMAGE/TRAINER_BASE arguments.
# - Where the CPU wheel index (download.pytorch.org) is unreachable, torch comes from PyPI (its Linux wheel pulls
#   the CUDA libraries: a larger image that still runs on CPU).
# - Cached by content: the images carry a label with the hash of everything that goes into them (the Dockerfile,
#   pyproject.toml, README.md, trainer/, operator/, the base, the build arguments); when both images in the store
#   carry the current hash, nothing is built. Layers are cached too (buildah --layers), and pip's downloads live in
#   a cache mount (the Dockerfile's RUN --mount=type=cache), so a change to seqtrain's source never downloads torch
#   again.
# Environment: IMAGE_BUILDER=docker|buildah forces one; SEQTRAIN_BASE_IMAGE=REF skips the probe and uses REF.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
TRAINER_IMAGE=${1:?usage: scripts/images.sh TRAINER_IMAGE OPERATOR_IMAGE}
OPERATOR_IMAGE=${2:?usage: scripts/images.sh TRAINER_IMAGE OPERATOR_IMAGE}
DEFAULT_BASE=python:3.11-slim-bookworm
LOCAL_BASE=localhost/seqtrain/python:3.11-bookworm
CPU_INDEX=https://download.pytorch.org/whl/cpu
LABEL=dev.seqtrain.inputs

log() { echo "images: $*" >&2; }
lim() { local v; v=$(ulimit "$1"); [[ $v == unlimited ]] && v=-1; echo "$v"; }  # -1: unlimited
# runc (crun refuses hybrid cgroup v1/v2 hosts), and the open-files limit this shell has: the runtimes' defaults
# raise RLIMIT_NOFILE/NPROC, which fails without CAP_SYS_RESOURCE (containers, some VMs). NPROC: 32768 (values
# above it failed on the CI VM even where they did not raise the limit).
OCI_ARGS=(--runtime runc --ulimit "nofile=$(lim -Sn):$(lim -Hn)" --ulimit "nproc=32768:32768")
die() { echo "images: $*" >&2; exit 1; }

builder() {
    if [[ -n ${IMAGE_BUILDER:-} ]]; then echo "$IMAGE_BUILDER"; return; fi
    if command -v docker >/dev/null 2>&1 && timeout 20 docker info >/dev/null 2>&1; then echo docker; return; fi
    echo buildah
}

need_debs() {  # command... : install the Debian packages named like the commands when one is missing
    local missing=() c
    for c in "$@"; do command -v "$c" >/dev/null 2>&1 || missing+=("$c"); done
    (( ${#missing[@]} == 0 )) && return 0
    command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]] \
        || die "no Docker engine and no ${missing[*]}: install Docker, or buildah, podman and mmdebstrap (Debian/Ubuntu packages)"
    log "installing ${missing[*]} (apt-get)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" runc fuse-overlayfs uidmap ca-certificates; } >&2 \
        || die "apt-get install ${missing[*]} failed"
}

inputs_hash() {  # extra strings... : the hash of every input of the build
    { sha256sum Dockerfile .dockerignore pyproject.toml README.md
      if git rev-parse --git-dir >/dev/null 2>&1; then
          git ls-files -z --cached --others --exclude-standard -- trainer operator
      else  # a source tarball: every file but bytecode
          find trainer operator -type f -print0
      fi | grep -zv -e '__pycache__' -e '\.pyc$' -e '\.egg-info/' | sort -z | xargs -0 sha256sum
      printf '%s\n' "$@"; } | sha256sum | cut -c1-32
}

# ---- the local base: Debian bookworm's python3 (3.11) with a venv on PATH, as python:3.11-slim has pip on PATH ----
local_base() {
    need_debs mmdebstrap
    # The machine's own extra CAs (a TLS-intercepting proxy's, as here) are trusted inside too, and pip uses the
    # system bundle: the build reaches PyPI the way this machine does.
    local cas; cas=$(cat /usr/local/share/ca-certificates/*.crt 2>/dev/null | sha256sum | cut -c1-16)
    local recipe="bookworm minbase python3 python3-venv ca-certificates venv:/opt/python cas:$cas v2"
    local want; want=$(printf '%s' "$recipe" | sha256sum | cut -c1-16)
    if [[ $(podman image inspect --format "{{index .Labels \"$LABEL\"}}" "$LOCAL_BASE" 2>/dev/null || true) == "$want" ]]; then
        return 0
    fi
    local tmp; tmp=$(mktemp -d)
    local sources=/etc/apt/sources.list.d/debian.sources
    [[ -f $sources ]] || sources=http://deb.debian.org/debian
    log "building the local base $LOCAL_BASE with mmdebstrap (Debian bookworm, python3 3.11)"
    # shellcheck disable=SC2016  # "$1" is the hook's argument (the root folder), expanded by mmdebstrap
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
        --customize-hook='chroot "$1" python3 -m venv /opt/python' \
        --customize-hook='for f in /usr/local/share/ca-certificates/*.crt; do [ -e "$f" ] && cp "$f" "$1/usr/local/share/ca-certificates/"; done; chroot "$1" update-ca-certificates >/dev/null' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        bookworm "$tmp/rootfs.tar" "$sources" >&2
    podman import --change "ENV=PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
        --change "ENV=LANG=C.UTF-8" --change "ENV=PIP_CERT=/etc/ssl/certs/ca-certificates.crt" \
        --change "ENV=SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" --change 'CMD=["python3"]' --change "LABEL=$LABEL=$want" \
        "$tmp/rootfs.tar" "$LOCAL_BASE" >/dev/null
    rm -rf "$tmp"
}

base_image() {  # builder -> the base to use
    if [[ -n ${SEQTRAIN_BASE_IMAGE:-} ]]; then echo "$SEQTRAIN_BASE_IMAGE"; return; fi
    if [[ $1 == docker ]]; then
        if docker image inspect "$DEFAULT_BASE" >/dev/null 2>&1 || timeout 120 docker pull -q "$DEFAULT_BASE" >/dev/null 2>&1; then
            echo "$DEFAULT_BASE"; return
        fi
        die "cannot pull $DEFAULT_BASE with docker; set SEQTRAIN_BASE_IMAGE or IMAGE_BUILDER=buildah"
    fi
    if podman image exists "docker.io/library/$DEFAULT_BASE" \
        || timeout 60 podman pull -q "docker.io/library/$DEFAULT_BASE" >/dev/null 2>&1; then
        echo "docker.io/library/$DEFAULT_BASE"; return
    fi
    log "$DEFAULT_BASE cannot be pulled (no registry reachable): local base from Debian's packages"
    local_base
    echo "$LOCAL_BASE"
}

torch_index() {
    if curl -fsS -o /dev/null --max-time 15 "$CPU_INDEX/torch/"; then echo "$CPU_INDEX"; return; fi
    log "$CPU_INDEX unreachable: torch from PyPI (its Linux wheel brings the CUDA libraries)"
    echo https://pypi.org/simple
}

label_of() {  # tool image
    if [[ $1 == docker ]]; then docker image inspect --format "{{index .Config.Labels \"$LABEL\"}}" "$2" 2>/dev/null || true
    else podman image inspect --format "{{index .Labels \"$LABEL\"}}" "$2" 2>/dev/null || true; fi
}

main() {
    local tool; tool=$(builder)
    [[ $tool == buildah ]] && need_debs buildah podman runc
    local base index hash
    base=$(base_image "$tool")
    index=$(torch_index)
    local base_id
    if [[ $tool == docker ]]; then base_id=$(docker image inspect --format '{{.Id}}' "$base")
    else base_id=$(podman image inspect --format '{{.Id}}' "$base"); fi
    hash=$(inputs_hash "$base_id" "$index")
    if [[ $(label_of "$tool" "$TRAINER_IMAGE") == "$hash" && $(label_of "$tool" "$OPERATOR_IMAGE") == "$hash" ]]; then
        log "up to date ($TRAINER_IMAGE, $OPERATOR_IMAGE: inputs $hash)"
        return 0
    fi
    local args=(--build-arg "PYTHON_IMAGE=$base" --build-arg "TRAINER_BASE=$base" --build-arg "TORCH_INDEX_URL=$index"
                --label "$LABEL=$hash")
    local target image
    for target in trainer operator; do
        image=$TRAINER_IMAGE; [[ $target == operator ]] && image=$OPERATOR_IMAGE
        log "building $image ($tool, base $base)"
        if [[ $tool == docker ]]; then
            DOCKER_BUILDKIT=1 docker build "${args[@]}" --target "$target" -t "$image" .
        else
            # --network host: pip reaches PyPI the way this machine does; --layers: unchanged steps are reused.
            buildah bud --layers --network host --pull=false "${OCI_ARGS[@]}" "${args[@]}" --target "$target" -t "$image" .
        fi
    done
    log "built $TRAINER_IMAGE $OPERATOR_IMAGE (inputs $hash)"
}

main
