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

{{- define "seqtrain.webhookService" -}}
{{- printf "%s-webhook" (include "seqtrain.fullname" .) -}}
{{- end -}}

{{/* Rules for what the operator writes, granted cluster-wide or per watched namespace. */}}
{{- define "seqtrain.namespacedRules" -}}
- apiGroups: ["seqtrain.dev"]
  resources: ["seqtrainjobs"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["seqtrain.dev"]
  resources: ["seqtrainjobs/status"]
  verbs: ["get", "patch"]
# ownerReferences with blockOwnerDeletion on the gang's objects: OwnerReferencesPermissionEnforcement requires it.
- apiGroups: ["seqtrain.dev"]
  resources: ["seqtrainjobs/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete", "deletecollection"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "deletecollection"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["scheduling.x-k8s.io", "scheduling.volcano.sh", "scheduling.run.ai"]
  resources: ["podgroups"]
  verbs: ["get", "create", "delete"]
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end -}}

{{/* Read-only cluster-wide rules: node inventory, pods bound to nodes, CRD discovery, cluster peering. */}}
{{- define "seqtrain.clusterRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end -}}
