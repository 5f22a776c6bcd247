#!/usr/bin/env bash
# Gets the control-plane binaries the test suite runs: etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler (one pinned Kubernetes release) and kwok (the release built against it).
#
# They are built from the Go modules with the installed Go toolchain, since these machines reach the Go
# module proxy but no release download. k8s.io/kubernetes is not meant to be a dependency: its go.mod
# points each staging module (k8s.io/api, k8s.io/client-go, ...) at ./staging, so it builds only from a
# wrapper module that replaces each of them with the published v0.X version; the list is generated from
# its own go.mod. etcd's server is built from the same wrapper, at the version Kubernetes pins.
#
# Binaries are cached outside the clone, keyed by version, so only the first run on a machine pays for
# the build (about half an hour on 2 cores). Prints the folder that holds them; exit 1 when a build fails.
#
#   scripts/k8s-binaries.sh           # build if missing, print the folder
#   scripts/k8s-binaries.sh --check   # exit 0 when the cache is complete, 1 otherwise; builds nothing
#   scripts/k8s-binaries.sh --oldest [--check]  # the same for the oldest release the chart claims
#   scripts/k8s-binaries.sh [--oldest] --version  # the Kubernetes version it builds; builds nothing
set -euo pipefail

# The oldest minor release charts/seqtrain/Chart.yaml's kubeVersion claims, at its newest patch the module proxy
# serves with every staging module (v1.29.6 lacks k8s.io/endpointslice, k8s.io/kube-controller-manager and
# k8s.io/legacy-cloud-providers there). tests/integration/test_oldest_kubernetes.py runs the chart on it.
OLDEST_K8S_VERSION=v1.29.15
K8S_VERSION=${SEQTRAIN_K8S_VERSION:-v1.36.1}
if [[ ${1:-} == --oldest ]]; then K8S_VERSION=$OLDEST_K8S_VERSION; shift; fi
if [[ ${1:-} == --version ]]; then echo "$K8S_VERSION"; exit 0; fi
KWOK_VERSION=${SEQTRAIN_KWOK_VERSION:-v0.8.0}
CACHE_ROOT=${SEQTRAIN_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/seqtrain/k8s}
# -b2: the build recipe (b2 stamps the release version into the binaries); a new recipe is a new cache folder.
DEST="$CACHE_ROOT/kubernetes-$K8S_VERSION-kwok-$KWOK_VERSION-b2"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)

# kwok's default "fast" stages (nodes initialize and renew their Lease; pods become ready, complete, are deleted):
# kwok runs nothing without stages, and its binary does not embed them.
STAGES=(node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml
        pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml)

have_binaries() {
    local b
    for b in "${BINARIES[@]}"; do [[ -x "$DEST/$b" ]] || return 1; done
}
complete() { have_binaries && [[ -s $DEST/kwok-stages.yaml ]]; }

kwok_stages() {  # from the kwok module (the Go module cache; downloaded if missing)
    local dir f
    dir=$(cd / && GOFLAGS= go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
    for f in "${STAGES[@]}"; do echo "---"; cat "$dir/kustomize/stage/$f"; done >"$DEST/kwok-stages.yaml.tmp"
    mv "$DEST/kwok-stages.yaml.tmp" "$DEST/kwok-stages.yaml"
}

if [[ ${1:-} == --check ]]; then
    complete && { echo "$DEST"; exit 0; }
    exit 1
fi
if complete; then echo "$DEST"; exit 0; fi

if ! command -v go >/dev/null; then
    echo "k8s-binaries: no Go toolchain on PATH; install Go 1.26+ (or put the release binaries in $DEST)" >&2
    exit 1
fi

# One build at a time per machine (parallel pytest sessions, two clones).
mkdir -p "$CACHE_ROOT"
exec 9>"$DEST.lock"  # per version: other caches under $CACHE_ROOT build independently
flock 9
if complete; then echo "$DEST"; exit 0; fi
if have_binaries; then kwok_stages; echo "$DEST"; exit 0; fi

WORK=$(mktemp -d "$CACHE_ROOT/.build-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export GOFLAGS=-mod=mod CGO_ENABLED=0 GOTOOLCHAIN=local
LDFLAGS="-s -w"
echo "k8s-binaries: building Kubernetes $K8S_VERSION and kwok $KWOK_VERSION into $DEST (first run only)" >&2

cd "$WORK"
go mod init seqtrain.dev/testbed-binaries >/dev/null 2>&1
KMOD=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
STAGING_VERSION="v0.${K8S_VERSION#v1.}"
{
    echo "require k8s.io/kubernetes $K8S_VERSION"
    # `k8s.io/foo => ./staging/src/k8s.io/foo` in Kubernetes' go.mod becomes `k8s.io/foo => k8s.io/foo v0.X.Y`.
    sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._/-]*\) => \./staging/src/.*#replace \1 => \1 '"$STAGING_VERSION"'#p' "$KMOD"
} >>go.mod
if ! grep -q '^replace ' go.mod; then
    echo "k8s-binaries: found no staging replace lines in $KMOD" >&2
    exit 1
fi
cat >tools.go <<'GO'
//go:build tools

package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
GO
go mod tidy -e >/dev/null
mkdir -p out
# The version the apiserver reports (/version): without it, v0.0.0-master, which Helm charts' kubeVersion refuse.
KV=k8s.io/component-base/version
MINOR=${K8S_VERSION#v1.}; MINOR=${MINOR%%.*}
K8S_LDFLAGS="$LDFLAGS -X $KV.gitVersion=$K8S_VERSION -X $KV.gitMajor=1 -X $KV.gitMinor=$MINOR -X $KV.gitTreeState=clean"
K8S_LDFLAGS+=" -X $KV.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
go build -trimpath -ldflags "$K8S_LDFLAGS" -o out/ \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler
go build -trimpath -ldflags "$LDFLAGS" -o out/etcd go.etcd.io/etcd/server/v3
GOBIN="$WORK/out" go install -trimpath -ldflags "$LDFLAGS" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"

mkdir -p "$DEST"
for b in "${BINARIES[@]}"; do install -m 0755 "out/$b" "$DEST/$b"; done
kwok_stages
echo "k8s-binaries: done" >&2
echo "$DEST"
