#!/usr/bin/env bash
# End to end on kind (`make kind-e2e`): a real cluster, the real images, the Helm chart.
#   1. kind cluster: one control plane, two workers sharing a host folder (a ReadWriteMany checkpoint volume)
#   2. build the trainer and operator images and load them into kind
#   3. helm install charts/seqtrain; wait for the operator
#   4. examples/k8s-cpu.yaml -> wait for Succeeded
#   5. again under another name; delete a trainer pod mid-run -> the gang restarts from a checkpoint -> Succeeded
#   6. GPU topology variant (E2E_FAKE_GPUS=1, default on): fake nvidia.com/gpu capacity and topology labels on the
#      workers; a GPU job must be placed (status.placement, node affinity) as the topology policy says
#   7. pytest tests/e2e against the cluster
# Environment: CLUSTER (seqtrain-e2e), KEEP=1 keeps the cluster, E2E_FAKE_GPUS=0 skips step 6,
# SKIP_BUILD=1 reuses images already loaded. Every wait has a deadline.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
CLUSTER=${CLUSTER:-seqtrain-e2e}
NS=${NS:-seqtrain-e2e}
KEEP=${KEEP:-0}
E2E_FAKE_GPUS=${E2E_FAKE_GPUS:-1}
CKPT_HOST_DIR=${CKPT_HOST_DIR:-/tmp/${CLUSTER}-checkpoints}
PATH="$ROOT/.tools/bin:$PATH"
# The names `make images` builds: the chart's and the spec's defaults (no image overrides below).
read -r TRAINER_IMAGE OPERATOR_IMAGE < <(make -s print-images)

log() { printf '\n== %s\n' "$*"; }
die() { printf 'kind-e2e: %s\n' "$*" >&2; exit 1; }
for tool in kind docker kubectl helm; do
  command -v "$tool" >/dev/null || die "$tool not found (kubectl and helm: make tools; kind: https://kind.sigs.k8s.io)"
done

cleanup() {
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    log "failed (exit $rc): operator logs and job status"
    kubectl -n seqtrain-system logs deploy/seqtrain --tail=200 || true
    kubectl -n "$NS" get seqtrainjobs,pods -o wide || true
    kubectl -n "$NS" get events --sort-by=.lastTimestamp | tail -40 || true
  fi
  if [[ $KEEP != 1 ]]; then kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

wait_phase() {  # job phase timeout_seconds
  local job=$1 phase=$2 deadline=$((SECONDS + $3)) current
  while (( SECONDS < deadline )); do
    current=$(kubectl -n "$NS" get seqtrainjob "$job" -o jsonpath='{.status.phase}' 2>/dev/null || true)
    [[ $current == "$phase" ]] && return 0
    [[ $current == Failed && $phase != Failed ]] && die "$job failed: $(kubectl -n "$NS" get stj "$job" -o jsonpath='{.status.message}')"
    sleep 3
  done
  die "$job did not reach $phase within $3s (phase: ${current:-none})"
}

wait_step() {  # job min_step timeout_seconds
  local job=$1 want=$2 deadline=$((SECONDS + $3)) step
  while (( SECONDS < deadline )); do
    step=$(kubectl -n "$NS" get seqtrainjob "$job" -o jsonpath='{.status.progress.step}' 2>/dev/null || true)
    [[ -n $step && $step -ge $want ]] && return 0
    sleep 2
  done
  die "$job did not reach step $want within $3s (step: ${step:-none})"
}

log "kind cluster $CLUSTER (1 control plane, 2 workers)"
mkdir -p "$CKPT_HOST_DIR" && chmod 0777 "$CKPT_HOST_DIR"
if ! kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  kind create cluster --name "$CLUSTER" --wait 120s --config - <<EOF
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
  - role: worker
    extraMounts: [{hostPath: "$CKPT_HOST_DIR", containerPath: /mnt/seqtrain-ckpt}]
  - role: worker
    extraMounts: [{hostPath: "$CKPT_HOST_DIR", containerPath: /mnt/seqtrain-ckpt}]
EOF
fi
kubectl config use-context "kind-$CLUSTER"

if [[ ${SKIP_BUILD:-0} != 1 ]]; then
  log "build and load images"
  make images
fi
kind load docker-image --name "$CLUSTER" "$TRAINER_IMAGE" "$OPERATOR_IMAGE"

log "install the chart"
helm upgrade --install seqtrain charts/seqtrain --namespace seqtrain-system --create-namespace \
  --set image.pullPolicy=Never \
  --set fullnameOverride=seqtrain --wait --timeout 180s
kubectl -n seqtrain-system rollout status deploy/seqtrain --timeout=180s
kubectl wait --for=condition=Established crd/seqtrainjobs.seqtrain.dev --timeout=60s

log "namespace $NS with a ReadWriteMany checkpoint volume (the same host folder on both workers)"
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -f - <<EOF
apiVersion: v1
kind: PersistentVolume
metadata: {name: ${NS}-ckpt}
spec:
  capacity: {storage: 5Gi}
  accessModes: [ReadWriteMany]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: seqtrain-e2e
  hostPath: {path: /mnt/seqtrain-ckpt, type: Directory}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: seqtrain-ckpt, namespace: $NS}
spec:
  accessModes: [ReadWriteMany]
  storageClassName: seqtrain-e2e
  volumeName: ${NS}-ckpt
  resources: {requests: {storage: 5Gi}}
EOF

log "the webhook rejects an invalid job with the field to fix"
if out=$(kubectl -n "$NS" apply -f - 2>&1 <<EOF
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: invalid}
spec: {replicas: 2, training: {globalBatchSize: 3, microBatchSize: 1}}
EOF
); then die "an invalid job was admitted"; fi
grep -q "spec.training.globalBatchSize" <<<"$out" || die "webhook message does not name the field: $out"

log "run 1: examples/k8s-cpu.yaml until Succeeded"
kubectl -n "$NS" apply -f examples/k8s-cpu.yaml
wait_phase cpu-demo Succeeded 900
kubectl -n "$NS" get seqtrainjob cpu-demo

log "run 2: delete a trainer pod mid-run; the gang must restart from a checkpoint and succeed"
sed 's/name: cpu-demo/name: cpu-recover/' examples/k8s-cpu.yaml | kubectl -n "$NS" apply -f -
wait_phase cpu-recover Running 600
wait_step cpu-recover 15 600   # past the checkpoint at step 10
victim=$(kubectl -n "$NS" get pods -l seqtrain.dev/job=cpu-recover,seqtrain.dev/replica=1 -o name | head -1)
[[ -n $victim ]] || die "no trainer pod to delete"
kubectl -n "$NS" delete "$victim" --wait=false
wait_phase cpu-recover Succeeded 900
restarts=$(kubectl -n "$NS" get stj cpu-recover -o jsonpath='{.status.restarts} {.status.infraRestarts}')
attempt=$(kubectl -n "$NS" get stj cpu-recover -o jsonpath='{.status.attempt}')
(( attempt >= 2 )) || die "expected a gang restart, status.attempt is $attempt (restarts: $restarts)"
kubectl -n "$NS" get stj cpu-recover -o jsonpath='{.status.lastCheckpoint}{"\n"}{.status.stepsLost}{"\n"}'

if [[ $E2E_FAKE_GPUS == 1 ]]; then
  log "GPU topology variant: fake GPUs and topology labels on the workers; placement only (no device plugin)"
  read -r -a workers <<<"$(kubectl get nodes -l '!node-role.kubernetes.io/control-plane' -o jsonpath='{.items[*].metadata.name}')"
  rack=0
  for n in "${workers[@]}"; do
    kubectl label node "$n" --overwrite topology.kubernetes.io/zone=zone-a example.com/rack="rack-$rack" \
      nvidia.com/gpu.product=FAKE-GPU
    kubectl patch node "$n" --subresource=status --type=merge \
      -p '{"status":{"capacity":{"nvidia.com/gpu":"4"},"allocatable":{"nvidia.com/gpu":"4"}}}'
    rack=$((rack + 1))
  done
  kubectl -n "$NS" apply -f - <<EOF
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: gpu-place}
spec:
  image: $TRAINER_IMAGE
  replicas: 2
  resources: {gpus: 2, cpu: 100m, memory: 256Mi, gpuProduct: FAKE-GPU}
  training: {steps: 10, globalBatchSize: 4, microBatchSize: 1}
  scheduling: {topology: {policy: require, keys: [example.com/rack]}}
EOF
  deadline=$((SECONDS + 120))
  until [[ $(kubectl -n "$NS" get stj gpu-place -o jsonpath='{.status.placement[*].node}' | wc -w) -eq 2 ]]; do
    (( SECONDS < deadline )) || die "gpu-place was never placed"
    sleep 2
  done
  nodes=$(kubectl -n "$NS" get stj gpu-place -o jsonpath='{.status.placement[*].node}')
  [[ $(tr ' ' '\n' <<<"$nodes" | sort -u | wc -l) -eq 1 ]] || die "policy require put replicas in two racks: $nodes"
  kubectl -n "$NS" delete stj gpu-place --wait=true --timeout=120s
fi

log "pytest e2e against the cluster"
if [[ -x .venv/bin/python ]]; then
  SEQTRAIN_E2E_NAMESPACE=$NS .venv/bin/python -m pytest -q -m e2e tests/e2e
fi
log "kind e2e passed"
