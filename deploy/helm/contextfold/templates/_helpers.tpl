{{- define "contextfold.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "contextfold.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "contextfold.labels" -}}
app.kubernetes.io/name: {{ include "contextfold.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "contextfold.selector" -}}
app.kubernetes.io/name: {{ include "contextfold.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "contextfold.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "contextfold.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "contextfold.fullname" .)) -}}
{{- end -}}

{{/* Environment of every contextfold container: the config file, the log
     filter, and each secret key as the variable that reads it. */}}
{{- define "contextfold.env" -}}
- name: CONTEXTFOLD_CONFIG
  value: /etc/contextfold/contextfold.toml
- name: CONTEXTFOLD_LOG
  value: {{ .Values.log | quote }}
- name: CONTEXTFOLD_NATS__CONNECTION__NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- $secret := include "contextfold.secretName" . }}
{{- range $key, $var := dict "apiKey" "OPENAI_API_KEY" "natsUser" "CONTEXTFOLD_NATS__CONNECTION__USER" "natsPassword" "CONTEXTFOLD_NATS__CONNECTION__PASSWORD" "natsToken" "CONTEXTFOLD_NATS__CONNECTION__TOKEN" }}
{{- if or $.Values.secrets.existingSecret (index $.Values.secrets $key) }}
- name: {{ $var }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $key }}
      optional: true
{{- end }}
{{- end }}
{{- if .Values.secrets.natsCreds }}
- name: CONTEXTFOLD_NATS__CONNECTION__CREDENTIALS_FILE
  value: /etc/contextfold/nats/nats.creds
{{- end }}
{{- end -}}

{{- define "contextfold.probes" -}}
livenessProbe:
  httpGet:
    path: {{ .Values.probes.liveness.path }}
    port: http
  initialDelaySeconds: {{ .Values.probes.liveness.initialDelaySeconds }}
  periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
  failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
readinessProbe:
  httpGet:
    path: {{ .Values.probes.readiness.path }}
    port: http
  initialDelaySeconds: {{ .Values.probes.readiness.initialDelaySeconds }}
  periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
  failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
{{- end -}}
