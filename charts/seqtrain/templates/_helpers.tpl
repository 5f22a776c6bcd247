{{- define "seqtrain.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "seqtrain.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "seqtrain.labels" -}}
app.kubernetes.io/name: {{ include "seqtrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "seqtrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "seqtrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "seqtrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "seqtrain.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "seqtrain.progressPushUrl" -}}
{{- .Values.progressPush.url | default (printf "http://%s-progress.%s.svc:%v" (include "seqtrain.fullname" .) .Release.Namespace .Values.progressPush.port) -}}
{{- end -}}

{{- define "seqtrain.webhookService" -}}
{{- printf "%s-webhook" (include "seqtrain.fullname" .) -}}
{{- end -}}

{{/*
RBAC: exactly what the operator calls (seqtrain_operator/k8s/api/client.py) and what kopf does for its handlers;
tests/unit/test_chart.py compares the rendered grants with that list, and the real-control-plane test checks them
with `kubectl auth can-i --list` as the ServiceAccount.
- seqtrainjobs: kopf lists/watches them and patches finalizers and its progress annotations; reconcile GETs one.
- seqtrainjobs/status: the status merge-patch. seqtrainjobs/finalizers update: owner references with
  blockOwnerDeletion on pods/Services/ConfigMaps are refused without it (OwnerReferencesPermissionEnforcement).
- pods: kopf's watch (wake-ups), reconcile's LIST by label, create, deletecollection (gang teardown, and the forced
  delete of pods on lost nodes). No get, no single delete: never called.
- services, configmaps, podgroups: create (409 = already there); configmaps deletecollection, podgroups delete;
  coscheduling's podgroups patch (an annotation on a queued gang: the plugin retries only on PodGroup updates).
- events: kopf.event POSTs core/v1 Events.
*/}}
{{- define "seqtrain.namespacedRules" -}}
- apiGroups: ["seqtrain.dev"]
  resources: ["seqtrainjobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["seqtrain.dev"]
  resources: ["seqtrainjobs/status"]
  verbs: ["patch"]
- apiGroups: ["seqtrain.dev"]
  resources: ["seqtrainjobs/finalizers"]
  verbs: ["update"]
# get, delete: an object whose name is taken by a deleted job's namesake is read (whose is it?) and deleted by uid
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete", "deletecollection", "patch"]  # patch: Kueue's retriable-in-group, finalizer
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "delete"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "delete", "deletecollection"]
- apiGroups: ["policy"]  # scheduling.podDisruptionBudget: one per job (owned by it, so GC deletes it)
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "delete"]
- apiGroups: [""]  # the webhook reads a job's checkpoint claim (its access modes)
  resources: ["persistentvolumeclaims"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["scheduling.x-k8s.io", "scheduling.volcano.sh", "scheduling.run.ai"]
  resources: ["podgroups"]
  verbs: ["get", "create", "delete"]
- apiGroups: ["scheduling.x-k8s.io"]  # coscheduling: touch a queued gang's PodGroup so the plugin retries it
  resources: ["podgroups"]
  verbs: ["patch"]
- apiGroups: ["kueue.x-k8s.io"]  # a finished pod group's Workload; a running one's priority boost
  resources: ["workloads"]
  verbs: ["delete", "patch"]
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- if .Values.progressPush.enabled }}
# progressPush: each attempt's push token as a Secret owned by the job (deleted with it). Create only: the operator
# never reads or deletes a Secret (neither could be narrowed to its own), so an attempt's stays until the job goes.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
{{- end }}
{{- if .Values.networkPolicy.enabled }}
- apiGroups: ["networking.k8s.io"]  # networkPolicy.enabled: one per job (owned by it, so GC deletes it)
  resources: ["networkpolicies"]
  verbs: ["get", "create", "delete"]
{{- end }}
{{- end -}}

{{/*
Read-only cluster-wide rules:
- nodes list/watch: native placement's inventory and the node-loss watch.
- pods list/watch cluster-wide: native placement subtracts the requests of EVERY pod bound to (or pinned to) a
  node, in any namespace, as kube-scheduler does; without it two tenants' jobs could both claim one node's GPUs.
- customresourcedefinitions: get (is an external gang scheduler installed?), list/watch (kopf's resource scan).
- namespaces list/watch: kopf resolves namespace globs (`--namespace=team-*`) by watching namespaces.
- clusterkopfpeerings: leader election of a cluster-wide operator.
*/}}
{{- define "seqtrain.clusterRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["scheduling.k8s.io"]
  resources: ["priorityclasses"]
  verbs: ["get"]
{{- end -}}

{{- /* The operator's resources for scale.jobs SeqTrainJobs of scale.pods trainer pods in all, from
`seqtrain bench operator` (docs/benchmarks.md, "Sizing the operator"): memory request = 120 MiB + 90 MiB per 1000
jobs + 10 MiB per 1000 pods (the peak RSS measured on 2026-11-27 fits 112 MiB + 55 KiB a job + 9.8 KiB a pod at
1000 x 1, 300 x 8, 1000 x 8 and 3000 x 8; gangs created beside the passes add up to 26 MiB per 1000 jobs in the
admission burst), limit = 1.5 x the request; cpu request = 250m + 100m per 1000 pods, no
CPU limit (a throttled operator answers the webhook late). scale.jobs unset: as many jobs as pods (one pod each,
the most a cluster of scale.pods pods can hold). */ -}}
{{- define "seqtrain.operatorResources" -}}
{{- $pods := int .Values.scale.pods -}}
{{- $jobs := int (default .Values.scale.pods .Values.scale.jobs) -}}
{{- $memory := add 120 (div (mul $jobs 90) 1000) (div (mul $pods 10) 1000) -}}
requests:
  cpu: {{ add 250 (div (mul $pods 100) 1000) }}m
  memory: {{ $memory }}Mi
limits:
  memory: {{ div (mul $memory 3) 2 }}Mi
{{- end -}}
