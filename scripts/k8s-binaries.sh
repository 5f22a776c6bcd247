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
set -euo pipefail

K8S_VERSION=${SEQTRAIN_K8S_VERSION:-v1.36.1}
KWOK_VERSION=${SEQTRAIN_KWOK_VERSION:-v0.8.0}
CACHE_ROOT=${SEQTRAIN_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/seqtrain/k8s}
DEST="$CACHE_ROOT/kubernetes-$K8S_VERSION-kwok-$KWOK_VERSION"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)

complete() {
    local b
    for b in "${BINARIES[@]}"; do [[ -x "$DEST/$b" ]] || return 1; done
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
exec 9>"$CACHE_ROOT/.lock"
flock 9
if complete; then echo "$DEST"; exit 0; fi

WORK=$(mktemp -d "$CACHE_ROOT/.build-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export GOFLAGS=-mod=mod CGO_ENABLED=0 GOTOOLCHAIN=local
# A version stamp, as release builds have: helm's kubeVersion checks and Kueue's server-version fetcher refuse
# the unstamped v0.0.0-master+$Format:%H$ (seen on the testbed).
V=k8s.io/component-base/version
LDFLAGS="-s -w -X $V.gitVersion=$K8S_VERSION -X $V.gitMajor=1 -X $V.gitMinor=$(echo "$K8S_VERSION" | cut -d. -f2) -X $V.gitTreeState=clean"
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
go build -trimpath -ldflags "$LDFLAGS" -o out/ \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler
go build -trimpath -ldflags "$LDFLAGS" -o out/etcd go.etcd.io/etcd/server/v3
GOBIN="$WORK/out" go install -trimpath -ldflags "$LDFLAGS" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"

mkdir -p "$DEST"
for b in "${BINARIES[@]}"; do install -m 0755 "out/$b" "$DEST/$b"; done
echo "k8s-binaries: done" >&2
echo "$DEST"
