#!/usr/bin/env bash
# The CustomResourceDefinitions of the external gang schedulers seqtrain drives, straight from each project's Go
# module (go mod download keeps them in the module cache, keyed by version: only the first run downloads).
# Prints one line per scheduler: NAME=FILE[,FILE...]. Nothing fetched is copied into this repository.
#
#   scripts/gang-crds.sh            # download if needed, print the files
#   scripts/gang-crds.sh --check    # print only what is already cached; exit 1 if something is missing
#
# Versions: the releases whose k8s.io client libraries are closest to the control plane's (Kubernetes 1.36).
# KAI: github.com/NVIDIA/KAI-scheduler is not served by the module proxy these machines reach (403 for every
# version); set SEQTRAIN_KAI_CRD=/path/to/scheduling.run.ai_podgroups.yaml (deployments/kai-scheduler/crds/ of
# a KAI release) to include it.
set -euo pipefail

KUEUE=${KUEUE_VERSION:-v0.19.2}                       # k8s.io/api v0.36.2
SCHEDULER_PLUGINS=${SCHEDULER_PLUGINS_VERSION:-v0.34.7}  # k8s.io/api v0.34.7 (newest release)
VOLCANO=${VOLCANO_VERSION:-v1.15.1}                   # k8s.io/api v0.35.3
check=false
[[ "${1:-}" == "--check" ]] && check=true

module_dir() {  # MODULE VERSION -> the module's directory in the cache
  local dir
  dir="$(go env GOMODCACHE)/$(echo "$1" | sed 's/[A-Z]/!\L&/g')@$2"
  if [[ -d "$dir" ]]; then echo "$dir"; return; fi
  if $check; then return 1; fi
  go mod download -json "$1@$2" | sed -n 's/^\s*"Dir": "\(.*\)",*$/\1/p'
}

missing=0
emit() {  # NAME MODULE VERSION RELATIVE-FILE...
  local name=$1 module=$2 version=$3 dir files=()
  shift 3
  if ! dir=$(module_dir "$module" "$version") || [[ -z "$dir" ]]; then
    echo "gang-crds: $module@$version not cached (run scripts/gang-crds.sh)" >&2; missing=1; return
  fi
  for f in "$@"; do files+=("$dir/$f"); done
  (IFS=,; echo "$name=${files[*]}")
}

if ! command -v go >/dev/null; then echo "gang-crds: no go toolchain" >&2; exit 1; fi
emit kueue sigs.k8s.io/kueue "$KUEUE" \
  config/components/crd/bases/kueue.x-k8s.io_workloads.yaml \
  config/components/crd/bases/kueue.x-k8s.io_localqueues.yaml \
  config/components/crd/bases/kueue.x-k8s.io_clusterqueues.yaml \
  config/components/crd/bases/kueue.x-k8s.io_resourceflavors.yaml
emit coscheduling sigs.k8s.io/scheduler-plugins "$SCHEDULER_PLUGINS" manifests/coscheduling/crd.yaml
emit volcano volcano.sh/volcano "$VOLCANO" \
  config/crd/volcano/bases/scheduling.volcano.sh_podgroups.yaml \
  config/crd/volcano/bases/scheduling.volcano.sh_queues.yaml
if [[ -n "${SEQTRAIN_KAI_CRD:-}" ]]; then echo "kai=$SEQTRAIN_KAI_CRD"; fi
exit $missing
