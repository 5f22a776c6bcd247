#!/usr/bin/env bash
# A real Kubernetes control plane on loopback for the tests (docs/development.md, "The testbed").
#
#   scripts/testbed.sh up              # start (idempotent); prints KUBECONFIG=<path> (.testbed/kubeconfig)
#   scripts/testbed.sh up --containers # the agent's nodes run pods as real containers from their images (podman +
#                                      # runc, tests/testbed/containers.py; root), and no kwok GPU nodes
#   scripts/testbed.sh load-images [IMAGE...]  # images into the container nodes' store (like `kind load
#                                      # docker-image`); default: `make print-images`
#   scripts/testbed.sh kill-container POD  # SIGKILL the main process of POD's container, as a crash would
#   scripts/testbed.sh down            # stop everything `up` started, by process id
#   scripts/testbed.sh status          # what runs
#   scripts/testbed.sh node-down NODE  # the node dies: heartbeats stop, its pod processes are SIGKILLed,
#                                      # no kubelet confirms a deletion there
#   scripts/testbed.sh node-up NODE    # it comes back
#
# etcd, kube-apiserver (TLS, client certificates, service-account tokens, Node+RBAC authorization, the admission
# plugins of a production cluster), kube-controller-manager (node lifecycle with short timings, garbage collector,
# service-account token controller, ...), kube-scheduler, kwok for the simulated GPU nodes, and the node agent
# (tests/testbed/node_agent.py) that runs the pods of the CPU nodes as local processes. Binaries: from
# $SEQTRAIN_K8S_BIN, else scripts/k8s-binaries.sh's cache. State: .testbed/ in the clone (TESTBED_DIR overrides).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TB=${TESTBED_DIR:-$ROOT/.testbed}
PKI=$TB/pki
PIDS=$TB/pids
LOGS=$TB/logs
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok node-agent)
AGENT_NODES=(cpu-0 cpu-1)
PY=${TESTBED_PYTHON:-$ROOT/.venv/bin/python}
CONTAINERS=0
KUBECTL=${KUBECTL:-$(command -v kubectl || echo "$ROOT/.tools/bin/kubectl")}
UP_TIMEOUT=${TESTBED_UP_TIMEOUT:-180}

die() { echo "testbed: $*" >&2; exit 1; }
log() { echo "testbed: $*" >&2; }

alive() { [[ -f $PIDS/$1 ]] && kill -0 "$(cat "$PIDS/$1")" 2>/dev/null; }

bin_dir() {
    if [[ -n ${SEQTRAIN_K8S_BIN:-} ]]; then echo "$SEQTRAIN_K8S_BIN"; return; fi
    "$ROOT/scripts/k8s-binaries.sh" --check 2>/dev/null \
        || die "no control-plane binaries; run scripts/k8s-binaries.sh (builds them once, ~30 min on 2 cores)"
}

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

kc() { "$KUBECTL" --kubeconfig "$TB/kubeconfig" "$@"; }

# --- certificates: a CA, the apiserver's serving cert, one client cert per component, the SA signing keys ---
pki() {
    [[ -f $PKI/done ]] && return 0
    rm -rf "$PKI"; mkdir -p "$PKI"
    ( cd "$PKI"
      openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 -subj "/CN=seqtrain-testbed-ca" \
          -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
      sign() {  # name subject extensions
          openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
          printf '%s\n' "$3" >"$1.ext"
          openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$1.crt" -days 3650 \
              -extfile "$1.ext" 2>/dev/null
          rm -f "$1.csr" "$1.ext"
      }
      sign apiserver "/CN=kube-apiserver" "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:10.96.0.1
extendedKeyUsage=serverAuth"
      # Local webhook servers (the operator in the tests) serve with this one: the apiserver calls https://127.0.0.1.
      sign webhook "/CN=127.0.0.1" "subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth"
      sign admin "/O=system:masters/CN=testbed-admin" "extendedKeyUsage=clientAuth"
      sign controller-manager "/CN=system:kube-controller-manager" "extendedKeyUsage=clientAuth"
      sign scheduler "/CN=system:kube-scheduler" "extendedKeyUsage=clientAuth"
      openssl genrsa -out sa.key 2048 2>/dev/null
      openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
      chmod 600 ./*.key
      touch done )
}

kubeconfig() {  # file user
    cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: testbed
  cluster: {server: "https://127.0.0.1:$API_PORT", certificate-authority: "$PKI/ca.crt"}
users:
- name: $2
  user: {client-certificate: "$PKI/$2.crt", client-key: "$PKI/$2.key"}
contexts:
- name: testbed
  context: {cluster: testbed, user: $2}
current-context: testbed
EOF
}

start() {  # name command...
    local name=$1; shift
    # setsid: its own session, so a Ctrl-C in the shell that ran `up` does not reach it; `down` stops it by pid.
    # 8>&-: not the lock `up`/`down` hold, or a later `up`/`down` would wait on it as long as this runs.
    setsid "$@" >"$LOGS/$name.log" 2>&1 </dev/null 8>&- &
    echo $! >"$PIDS/$name"
}

wait_for() {  # what seconds command...
    local what=$1 deadline=$((SECONDS + $2)); shift 2
    until "$@" >/dev/null 2>&1; do
        (( SECONDS < deadline )) || { log "$what not ready after ${UP_TIMEOUT}s; logs in $LOGS"; tail -20 "$LOGS"/*.log >&2 || true; return 1; }
        for c in "${COMPONENTS[@]}"; do
            if [[ -f $PIDS/$c ]] && ! alive "$c"; then log "$c exited; its log:"; tail -30 "$LOGS/$c.log" >&2; return 1; fi
        done
        sleep 1
    done
}

healthy() {
    curl -fsS --max-time 5 --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
        "https://127.0.0.1:$API_PORT/readyz" | grep -qx ok
}

all_nodes_ready() {
    local want=$1 got
    got=$(kc get nodes -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' | grep -cx True)
    [[ $got -ge $want ]]
}

# kwok's nodes: GPU pools with topology labels (zone > rack > NVLink domain); one pool tainted the way GKE and AKS
# taint GPU nodes. Labels the planner reads: nvidia.com/gpu.product, nvidia.com/gpu.memory.
kwok_nodes() {
    local name zone rack clique product taint
    while read -r name zone rack clique product taint; do
        cat <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: $name
  annotations: {kwok.x-k8s.io/node: fake, node.alpha.kubernetes.io/ttl: "0"}
  labels:
    type: kwok
    kubernetes.io/hostname: $name
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    node.kubernetes.io/instance-type: testbed-gpu
    topology.kubernetes.io/zone: $zone
    example.com/rack: $rack
    nvidia.com/gpu.clique: $clique
    nvidia.com/gpu.product: $product
    nvidia.com/gpu.memory: "81559"
    nvidia.com/gpu.count: "8"
spec:
$( [[ $taint == yes ]] && echo "  taints: [{key: nvidia.com/gpu, value: present, effect: NoSchedule}]" || echo "  taints: []" )
status:
  allocatable: {cpu: "32", memory: 256Gi, pods: "110", nvidia.com/gpu: "8", ephemeral-storage: 500Gi}
  capacity: {cpu: "32", memory: 256Gi, pods: "110", nvidia.com/gpu: "8", ephemeral-storage: 500Gi}
  nodeInfo: {architecture: amd64, operatingSystem: linux, kubeletVersion: fake}
EOF
    done <<'NODES'
gpu-a-0 zone-a rack-1 nvl-1 NVIDIA-H100-80GB-HBM3 no
gpu-a-1 zone-a rack-1 nvl-1 NVIDIA-H100-80GB-HBM3 no
gpu-a-2 zone-a rack-2 nvl-2 NVIDIA-H100-80GB-HBM3 no
gpu-a-3 zone-a rack-2 nvl-2 NVIDIA-H100-80GB-HBM3 no
gpu-t-0 zone-b rack-3 nvl-3 NVIDIA-H100-80GB-HBM3 yes
gpu-t-1 zone-b rack-3 nvl-3 NVIDIA-H100-80GB-HBM3 yes
NODES
}
NODE_COUNT=8  # 2 agent CPU nodes + 6 kwok GPU nodes

up() {
    mkdir -p "$TB" "$PIDS" "$LOGS"
    exec 8>"$TB/.lock"; flock -w 600 8 || die "another testbed.sh up/down holds $TB/.lock"
    if [[ -f $TB/ports ]]; then source "$TB/ports"; fi
    local running=0 c mode=processes
    (( CONTAINERS )) && mode=containers
    for c in "${COMPONENTS[@]}"; do alive "$c" && running=$((running + 1)); done
    if (( running == ${#COMPONENTS[@]} )) && [[ $(cat "$TB/mode" 2>/dev/null || echo processes) != "$mode" ]]; then
        log "running with pods as $(cat "$TB/mode" 2>/dev/null || echo processes): restarting with pods as $mode"
        stop_all; running=0
    fi
    if (( running == ${#COMPONENTS[@]} )) && healthy; then
        echo "KUBECONFIG=$TB/kubeconfig"; return 0
    fi
    (( running == 0 )) || { log "partly running: stopping it before a fresh start"; stop_all; }
    local bin; bin=$(bin_dir)
    [[ -x $PY ]] || die "no Python at $PY (make install, or TESTBED_PYTHON=...)"
    [[ -x $KUBECTL ]] || die "no kubectl (make tools)"
    if (( CONTAINERS )); then
        [[ $(id -u) == 0 ]] || die "--containers needs root (pod cgroups, rootful podman)"
        if ! command -v podman >/dev/null || ! command -v runc >/dev/null; then
            die "--containers needs podman and runc (Debian: apt-get install podman runc; make images installs them)"
        fi
    fi
    local t0=$SECONDS
    remove_containers
    rm -rf "$TB/etcd" "$TB/agent" "$LOGS"/*; mkdir -p "$LOGS"
    echo "$mode" >"$TB/mode"
    pki
    API_PORT=$(free_port); ETCD_PORT=$(free_port); PEER_PORT=$(free_port); KWOK_PORT=$(free_port)
    printf 'API_PORT=%s\nETCD_PORT=%s\nPEER_PORT=%s\nKWOK_PORT=%s\n' "$API_PORT" "$ETCD_PORT" "$PEER_PORT" "$KWOK_PORT" >"$TB/ports"
    kubeconfig "$TB/kubeconfig" admin
    kubeconfig "$TB/controller-manager.kubeconfig" controller-manager
    kubeconfig "$TB/scheduler.kubeconfig" scheduler

    start etcd "$bin/etcd" --name testbed --data-dir "$TB/etcd" \
        --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "http://127.0.0.1:$PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$PEER_PORT" \
        --initial-cluster "testbed=http://127.0.0.1:$PEER_PORT" --unsafe-no-fsync --quota-backend-bytes=2147483648 \
        --log-level=warn
    # Admission: the production set (kubeadm's defaults plus what managed clouds enable). NodeRestriction binds
    # kubelets (system:nodes); the agent and kwok authenticate as admins, so it checks nothing of theirs.
    local plugins=NamespaceLifecycle,LimitRanger,ServiceAccount,DefaultTolerationSeconds,DefaultStorageClass
    plugins+=,StorageObjectInUseProtection,PersistentVolumeClaimResize,RuntimeClass,CertificateApproval
    plugins+=,CertificateSigning,CertificateSubjectRestriction,TaintNodesByCondition,Priority,PodSecurity
    plugins+=,ExtendedResourceToleration,OwnerReferencesPermissionEnforcement,NodeRestriction
    plugins+=,MutatingAdmissionPolicy,MutatingAdmissionWebhook,ValidatingAdmissionPolicy,ValidatingAdmissionWebhook,ResourceQuota
    # An older kube-apiserver (the oldest release the chart claims: tests/integration/test_oldest_kubernetes.py) lacks
    # the newer plugins (MutatingAdmissionPolicy, from 1.32): keep those its --help lists, say which were dropped.
    local known p kept=() dropped=()
    known=$("$bin/kube-apiserver" --help 2>&1 | sed -n 's/.*Comma-delimited list of admission plugins: \(.*\)\. The order .*/\1/p' | head -1)
    [[ -n $known ]] || die "could not read the admission plugins from $bin/kube-apiserver --help"
    for p in ${plugins//,/ }; do
        if [[ ", $known, " == *", $p, "* ]]; then kept+=("$p"); else dropped+=("$p"); fi
    done
    (( ${#dropped[@]} == 0 )) || log "kube-apiserver $("$bin/kube-apiserver" --version | cut -d' ' -f2) has no ${dropped[*]}: not enabled"
    plugins=$(IFS=,; echo "${kept[*]}")
    start kube-apiserver "$bin/kube-apiserver" --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
        --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$API_PORT" \
        --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" --client-ca-file "$PKI/ca.crt" \
        --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
        --service-account-issuer https://kubernetes.default.svc.cluster.local \
        --authorization-mode Node,RBAC --enable-admission-plugins "$plugins" \
        --service-cluster-ip-range 10.96.0.0/16 --allow-privileged=true --endpoint-reconciler-type none \
        --enable-aggregator-routing=true \
        --kubelet-preferred-address-types InternalIP,Hostname \
        --default-not-ready-toleration-seconds 10 --default-unreachable-toleration-seconds 10 \
        --storage-media-type application/vnd.kubernetes.protobuf --profiling=false
    wait_for kube-apiserver "$UP_TIMEOUT" healthy || { stop_all; die "kube-apiserver did not start"; }
    # Node lifecycle in seconds, not minutes: a dead node is NotReady 10 s after its last heartbeat, and its pods
    # are evicted 10 s later (the apiserver's default tolerations above). Only the leader election is off.
    # TESTBED_NODE_GRACE_SECONDS raises the 10 s for hundreds of kwok nodes on a small machine (the benchmark).
    start kube-controller-manager "$bin/kube-controller-manager" --kubeconfig "$TB/controller-manager.kubeconfig" \
        --authentication-kubeconfig "$TB/controller-manager.kubeconfig" \
        --authorization-kubeconfig "$TB/controller-manager.kubeconfig" \
        --leader-elect=false --secure-port 0 --use-service-account-credentials \
        --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
        --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
        --controllers '*' --node-monitor-period 2s --node-monitor-grace-period "${TESTBED_NODE_GRACE_SECONDS:-10}s" \
        --node-startup-grace-period 20s --concurrent-gc-syncs 5 --profiling=false
    start kube-scheduler "$bin/kube-scheduler" --kubeconfig "$TB/scheduler.kubeconfig" \
        --authentication-kubeconfig "$TB/scheduler.kubeconfig" --authorization-kubeconfig "$TB/scheduler.kubeconfig" \
        --leader-elect=false --secure-port 0 --profiling=false
    # kwok manages only its nodes (label type=kwok), never the agent's. It renews a node's lease every quarter of
    # its duration: kwok's default (40 s: every 10 s) against the 10 s grace above made healthy nodes blink
    # NotReady whenever a renewal came a little late; 12 s renews every 3 s (TESTBED_KWOK_LEASE_SECONDS).
    start kwok "$bin/kwok" --kubeconfig "$TB/kubeconfig" --config "$bin/kwok-stages.yaml" \
        --node-lease-duration-seconds "${TESTBED_KWOK_LEASE_SECONDS:-12}" \
        --manage-nodes-with-label-selector type=kwok --cidr 10.244.0.0/16 --node-ip 10.0.0.1 \
        --server-address "127.0.0.1:$KWOK_PORT"
    # A Service's webhook is called at its endpoints (pod IPs), as no kube-proxy routes cluster IPs here.
    local agent_args=() nodes=$NODE_COUNT
    for c in "${AGENT_NODES[@]}"; do agent_args+=(--node "$c"); done
    if (( CONTAINERS )); then agent_args+=(--containers --label seqtrain.dev/testbed-runtime=containers); nodes=${#AGENT_NODES[@]}; fi
    start node-agent env PATH="$ROOT/.venv/bin:$PATH" PYTHONPATH="$ROOT/trainer:$ROOT/operator${PYTHONPATH:+:$PYTHONPATH}" \
        "$PY" "$ROOT/tests/testbed/node_agent.py" --kubeconfig "$TB/kubeconfig" --state "$TB/agent" \
        "${agent_args[@]}" --label topology.kubernetes.io/zone=zone-cpu --label node.kubernetes.io/instance-type=testbed-cpu
    if (( ! CONTAINERS )); then  # container nodes: a CPU job such as examples/k8s-cpu.yaml lands on them, as on kind
        kwok_nodes | kc apply -f - >/dev/null || { stop_all; die "could not create the kwok nodes"; }
    fi
    wait_for "nodes" "$UP_TIMEOUT" all_nodes_ready "$nodes" || { stop_all; die "nodes did not become Ready"; }
    # New namespaces need their default ServiceAccount before pods can be admitted (ServiceAccount plugin).
    wait_for "default service account" "$UP_TIMEOUT" kc get serviceaccount default -n default \
        || { stop_all; die "the service-account controller did not run"; }
    log "up in $((SECONDS - t0))s (logs: $LOGS)"
    echo "KUBECONFIG=$TB/kubeconfig"
}

stop_all() {
    local c pid i
    # Reverse order: nodes first, etcd last.
    for (( i=${#COMPONENTS[@]}-1; i>=0; i-- )); do
        c=${COMPONENTS[$i]}
        [[ -f $PIDS/$c ]] || continue
        pid=$(cat "$PIDS/$c")
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$PIDS/$c"
    done
}

down() {
    mkdir -p "$PIDS"
    exec 8>"$TB/.lock"; flock -w 120 8 || log "$TB/.lock still held after 120s: stopping anyway"
    stop_all
    # Pod processes the agent started (own process groups) die with it; any left (agent SIGKILLed) go here.
    if [[ -d $TB/agent/pods ]]; then
        local f
        for f in "$TB"/agent/pods/*/pgid*; do [[ -f $f ]] && kill -KILL -- "-$(cat "$f")" 2>/dev/null || true; done
    fi
    remove_containers
    log "down"
}

# The label tests/testbed/containers.py puts on this testbed's containers: a hash of the agent's state folder.
container_tag() { printf '%s' "$(realpath -m "$TB/agent")" | sha256sum | cut -c1-12; }

remove_containers() {
    command -v podman >/dev/null 2>&1 || return 0
    local ids=()
    mapfile -t ids < <(podman ps -aq --filter "label=seqtrain.dev/testbed=$(container_tag)" 2>/dev/null || true)
    (( ${#ids[@]} == 0 )) || podman rm -f -t 0 "${ids[@]}" >/dev/null 2>&1 || true
}

load_images() {  # IMAGE... : into podman's store (the container nodes' runtime), from Docker's when built there
    local images=("$@") img
    (( ${#images[@]} )) || read -r -a images < <(make -s -C "$ROOT" print-images)
    command -v podman >/dev/null || die "load-images: no podman (make images installs it)"
    for img in "${images[@]}"; do
        if podman image exists "$img"; then echo "$img: in the nodes' store"; continue; fi
        if command -v docker >/dev/null && docker image inspect "$img" >/dev/null 2>&1; then
            docker save "$img" | podman load >/dev/null || die "load-images: docker save | podman load $img failed"
            echo "$img: loaded from Docker"; continue
        fi
        die "load-images: $img is in no local store: run \`make images\` first"
    done
}

kill_container() {  # POD [NAMESPACE]
    local pod=${1:-} ns=${2:-}
    [[ -n $pod ]] || die "usage: testbed.sh kill-container POD [NAMESPACE]"
    local filters=(--filter "label=seqtrain.dev/testbed=$(container_tag)" --filter "label=io.kubernetes.pod.name=$pod")
    [[ -n $ns ]] && filters+=(--filter "label=io.kubernetes.pod.namespace=$ns")
    local ids; ids=$(podman ps -q "${filters[@]}")
    [[ -n $ids ]] || die "kill-container: no running container of pod $pod on the container nodes"
    (( $(wc -w <<<"$ids") == 1 )) || die "kill-container: pod $pod is in several namespaces: name one"
    local pid; pid=$(podman inspect --format '{{.State.Pid}}' "$ids")
    [[ $pid =~ ^[0-9]+$ && $pid -gt 0 ]] || die "kill-container: no main process for $pod ($ids)"
    kill -KILL "$pid"
    echo "pod $pod: SIGKILLed pid $pid (container ${ids:0:12})"
}

status() {
    local c any=0
    [[ -f $TB/ports ]] && source "$TB/ports"
    for c in "${COMPONENTS[@]}"; do
        if alive "$c"; then echo "$c running (pid $(cat "$PIDS/$c"))"; any=1; else echo "$c stopped"; fi
    done
    if (( any )) && [[ -n ${API_PORT:-} ]] && healthy; then
        echo "apiserver https://127.0.0.1:$API_PORT ready; KUBECONFIG=$TB/kubeconfig"
        kc get nodes -L type,nvidia.com/gpu.product 2>/dev/null || true
        local d; for d in "$TB"/agent/down/*; do [[ -e $d ]] && echo "node $(basename "$d") is down (node-down)"; done
    fi
    (( any ))
}

node_mark() {  # down|up NODE
    local node=$2
    [[ -n $node ]] || die "usage: testbed.sh node-$1 NODE"
    local is_agent=0 n
    for n in "${AGENT_NODES[@]}"; do [[ $n == "$node" ]] && is_agent=1; done
    (( is_agent )) || die "node-$1: $node is not run by the node agent (its nodes: ${AGENT_NODES[*]})"
    alive node-agent || die "node-$1: the testbed is not up"
    mkdir -p "$TB/agent/down"
    if [[ $1 == down ]]; then
        local before; before=$(grep -c "node $node down" "$LOGS/node-agent.log" || true)
        touch "$TB/agent/down/$node"
        # The agent acts on its next round; wait until it did (its log says so), with a deadline.
        local deadline=$((SECONDS + 30))
        until (( $(grep -c "node $node down" "$LOGS/node-agent.log" || true) > before )); do
            (( SECONDS < deadline )) || die "node-down: the agent did not take $node down within 30s"
            sleep 0.5
        done
    else
        rm -f "$TB/agent/down/$node"
    fi
    echo "node $node $1"
}

case ${1:-} in
    up) [[ ${2:-} == --containers ]] && CONTAINERS=1; up ;;
    load-images) shift; load_images "$@" ;;
    kill-container) kill_container "${2:-}" "${3:-}" ;;
    down) down ;;
    status) status ;;
    node-down) node_mark down "${2:-}" ;;
    node-up) node_mark up "${2:-}" ;;
    *) echo "usage: $0 up [--containers]|down|status|node-down NODE|node-up NODE|load-images [IMAGE...]|kill-container POD [NS]" >&2
       exit 2 ;;
esac
