{{- define "cache-indexer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "cache-indexer.fullname" -}}
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

{{- define "cache-indexer.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "cache-indexer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "cache-indexer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cache-indexer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "cache-indexer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "cache-indexer.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "cache-indexer.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The NATS URL: the bundled subchart's client Service, or externalNats.url. Mirrors the nats
     chart's own fullname rule so it also holds when this chart is a sub-chart of a suite. */}}
{{- define "cache-indexer.natsUrl" -}}
{{- if .Values.nats.enabled -}}
{{- $n := .Values.nats -}}
{{- $name := default "nats" $n.nameOverride -}}
{{- $full := "" -}}
{{- if $n.fullnameOverride -}}
{{- $full = $n.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains $name .Release.Name -}}
{{- $full = .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $full = printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- printf "nats://%s.%s.svc:4222" $full .Release.Namespace -}}
{{- else if .Values.externalNats.url -}}
{{- .Values.externalNats.url -}}
{{- else -}}
{{- fail "cache-indexer needs NATS with JetStream: set nats.enabled=true (bundled NATS chart) or externalNats.url" -}}
{{- end -}}
{{- end -}}

{{- define "cache-indexer.podMeta" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
