#!/usr/bin/env bash
# Builds the external gang schedulers the gang-scheduling tests run against the testbed, from their Go modules:
#   kueue                     sigs.k8s.io/kueue/cmd/kueue (Kueue's controller manager, webhooks included)
#   scheduler-plugins         sigs.k8s.io/scheduler-plugins/cmd/scheduler (kube-scheduler with Coscheduling)
# cached outside the clone keyed by version (only the first run builds; each is a multi-minute Go build).
# Each module is built inside a copy of itself so its own go.mod (with its replace directives) applies.
#
#   scripts/gang-schedulers.sh           # build what is missing, print the folder
#   scripts/gang-schedulers.sh --check [kueue|scheduler-plugins]   # exit 0 when cached (prints the folder)
set -euo pipefail

KUEUE=${KUEUE_VERSION:-v0.19.2}                       # k8s.io client libraries v0.36.2 (control plane: 1.36)
SCHEDULER_PLUGINS=${SCHEDULER_PLUGINS_VERSION:-v0.34.7}  # newest release (v0.34 libraries)
CACHE_ROOT=${SEQTRAIN_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/seqtrain/k8s}
DEST="$CACHE_ROOT/gang-kueue-$KUEUE-scheduler-plugins-$SCHEDULER_PLUGINS"

complete() { [[ -x "$DEST/kueue" && -x "$DEST/scheduler-plugins" ]]; }
if [[ ${1:-} == --check ]]; then
    if [[ -n ${2:-} ]]; then [[ -x "$DEST/$2" ]] && { echo "$DEST"; exit 0; }; exit 1; fi  # --check kueue
    complete && { echo "$DEST"; exit 0; }; exit 1
fi
if complete; then echo "$DEST"; exit 0; fi
command -v go >/dev/null || { echo "gang-schedulers: no Go toolchain on PATH" >&2; exit 1; }

mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/.lock"  # the same lock as k8s-binaries.sh: one Go build at a time on this machine
flock 9
if complete; then echo "$DEST"; exit 0; fi
WORK=$(mktemp -d "$CACHE_ROOT/.build-XXXXXX")
trap 'chmod -R u+w "$WORK" 2>/dev/null; rm -rf "$WORK"' EXIT
export GOFLAGS=-mod=mod CGO_ENABLED=0 GOTOOLCHAIN=local
mkdir -p "$DEST"

# Some module proxies lack a few patch releases of k8s.io staging modules (here: scheduler-plugins v0.34.7 needs
# e.g. k8s.io/csi-translation-lib v0.34.7, answered 403). Replace each missing one with the nearest older patch
# release of the same minor and say so: the staging modules keep their API within a minor release.
resolve_missing() {
    local i out mod ver minor p cand found
    for i in $(seq 1 40); do
        out=$(go mod download 2>&1 | grep -v '^go: downloading' || true)
        read -r mod ver < <(echo "$out" | grep -oE 'proxy[^ ]*/k8s\.io/[^@]+/@v/v[0-9.]+\.(mod|info|zip): 403' | head -1 |
            sed -E 's#.*/(k8s\.io/[^@]+)/@v/(v[0-9.]+)\..*#\1 \2#') || true
        [[ -z "${mod:-}" ]] && { [[ -z "$out" ]] && return 0; echo "$out" >&2; return 1; }
        minor=${ver%.*}; found=""
        for p in $(seq "${ver##*.}" -1 0); do
            cand="$minor.$p"; [[ $cand == "$ver" ]] && continue
            if go mod download -json "$mod@$cand" 2>/dev/null | grep -q '"Dir"'; then found=$cand; break; fi
        done
        [[ -z $found ]] && { echo "gang-schedulers: $mod $ver is not available, nor an older $minor.x" >&2; return 1; }
        echo "gang-schedulers: $mod $ver not served by the module proxy; using $found" >&2
        go mod edit -replace "$mod=$mod@$found"
        mod=""
    done
    return 1
}

build() {  # MODULE VERSION PACKAGE OUTPUT
    local dir
    dir=$(go mod download -json "$1@$2" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
    cp -r "$dir" "$WORK/$4" && chmod -R u+w "$WORK/$4"
    (cd "$WORK/$4" && resolve_missing)
    echo "gang-schedulers: building $1@$2 ./$3 (first run only)" >&2
    (cd "$WORK/$4" && go build -trimpath -ldflags "-s -w" -o "$DEST/$4.tmp" "./$3") && mv "$DEST/$4.tmp" "$DEST/$4"
}
[[ -x "$DEST/kueue" ]] || build sigs.k8s.io/kueue "$KUEUE" cmd/kueue kueue
[[ -x "$DEST/scheduler-plugins" ]] || build sigs.k8s.io/scheduler-plugins "$SCHEDULER_PLUGINS" cmd/scheduler scheduler-plugins
echo "$DEST"
