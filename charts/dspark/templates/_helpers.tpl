{{- define "dspark.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dspark.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dspark.labels" -}}
app.kubernetes.io/name: {{ include "dspark.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "dspark.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dspark.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "dspark.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dspark.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "dspark.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) -}}
{{- end -}}

{{- define "dspark.servingImage" -}}
{{- printf "%s:%s" .Values.serving.image.repository (default .Chart.AppVersion .Values.serving.image.tag) -}}
{{- end -}}

{{- /* The namespaces whose DSparkServices the operator reconciles; empty when it watches all. */ -}}
{{- define "dspark.watchNamespaces" -}}
{{- if not .Values.operator.clusterWide -}}
{{- join "," (default (list .Release.Namespace) .Values.operator.watchNamespaces) -}}
{{- end -}}
{{- end -}}
