{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "gso.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified release name. */}}
{{- define "gso.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "gso.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gso.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gso.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gso.labels" -}}
helm.sh/chart: {{ include "gso.chart" . }}
{{ include "gso.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gaudi-serve
{{- end -}}

{{- define "gso.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gso.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "gso.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Labels the operator puts on every runtime pod and Service (operator/gaudi_operator/render.py). */}}
{{- define "gso.runtimeSelector" -}}
app.kubernetes.io/name: gaudi-serve
app.kubernetes.io/managed-by: gaudi-serve-operator
{{- end -}}

{{/* namespaceSelector for monitors: the watched namespaces, or any. */}}
{{- define "gso.monitorNamespaces" -}}
{{- if .Values.watch.namespaces }}
matchNames:
{{- range .Values.watch.namespaces }}
  - {{ . | quote }}
{{- end }}
{{- else }}
any: true
{{- end }}
{{- end -}}

{{/* Namespaced rules: everything the operator reads and writes inside a watched namespace. */}}
{{/* The ClusterRole the RoleBinding of each picker the operator runs refers to. */}}
{{- define "gso.pickerClusterRole" -}}
{{- printf "%s-endpoint-picker" (include "gso.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gso.namespacedRules" -}}
# InferenceServices: read and watch; patch for Kopf's bookkeeping annotations.
- apiGroups: ["gaudiserve.io"]
  resources: ["inferenceservices"]
  verbs: ["get", "list", "watch", "patch"]
# Status is written with a merge patch of the status subresource.
- apiGroups: ["gaudiserve.io"]
  resources: ["inferenceservices/status"]
  verbs: ["patch"]
# Children, applied server-side (create is needed when an apply creates the object); listed by
# label to find the ones each component owns; only the optional ones are ever deleted (the
# PodDisruptionBudget at one replica, the NetworkPolicy when the spec drops it, the autoscaler that
# spec.autoscaling no longer asks for, the pool and route of spec.gateway). The rest goes by
# garbage collection. No Secrets: a spec's Secret references (hubTokenSecretRef, apiKeySecretRef)
# are resolved by the kubelet, never read by the operator.
# Exactly what the operator uses: tests/e2e/test_8_rbac.py checks it against the audit log.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["list", "watch", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["list", "watch", "create", "patch", "delete"]
# NetworkPolicy (spec.networkPolicy): deleted when the spec drops it.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["list", "watch", "create", "patch", "delete"]
# spec.autoscaling: a HorizontalPodAutoscaler, or a KEDA ScaledObject (where KEDA is installed).
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["list", "watch", "create", "patch", "delete"]
# spec.gateway: an InferencePool and an HTTPRoute (where the Gateway API and its inference extension are
# installed); the route's status, which the Gateway's controller writes, comes back with each apply.
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["list", "watch", "create", "patch", "delete"]
{{- if .Values.gateway.endpointPicker.image }}
# The endpoint pickers it runs (gateway.endpointPicker.image): a ServiceAccount, a RoleBinding to
# the chart's picker ClusterRole (binding it needs `bind` on that one role, not its rights), a
# Deployment and a Service, each named <service>-epp, listed by label (what the operator owns),
# deleted when the spec no longer wants them.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["rolebindings"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["clusterroles"]
  verbs: ["bind"]
  resourceNames: [{{ include "gso.pickerClusterRole" . | quote }}]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["delete"]
{{- end }}
# Pods: observed (watched) for status and warmup progress, never changed.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# The model-cache download Jobs (spec.model.cache.prefetch): created, joined by each InferenceService
# naming the same model (an ownerReference added by patch), deleted by the last one to leave; the
# progress is the last line of their pod's log.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
# Events on phase changes.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if .Values.peering.enabled }}
# Kopf peering in namespaced mode (one KopfPeering per watched namespace).
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end -}}
