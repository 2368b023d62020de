{{- define "ddtree.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ddtree.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "ddtree.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "ddtree.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ddtree.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ddtree.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ddtree.labels" -}}
{{ include "ddtree.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "ddtree.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ddtree.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Exactly the verbs the operator calls (tests/operator/test_rbac.py measures them from the API server's audit
log): server-side apply is `patch`, and `create` when it creates; only kinds it prunes are listed and deleted;
Deployments, Jobs and pods are watched so that their changes reach the status at once; Jobs are created once and
never changed; pods are only read. No Secrets: tokens reach pods by reference. */}}
{{- define "ddtree.rules" -}}
- apiGroups: [ddtree.io]
  resources: [ddtreedeployments]
  verbs: [list, watch, patch]
- apiGroups: [ddtree.io]
  resources: [ddtreedeployments/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [services, persistentvolumeclaims]
  verbs: [get, create, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, create, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors, podmonitors]
  verbs: [get, list, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, create, patch, delete]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, list, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}
