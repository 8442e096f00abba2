{{- define "vllm-guard.name" -}}vllm-guard{{- end -}}

{{- define "vllm-guard.fullname" -}}
{{- if contains "vllm-guard" .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-vllm-guard" .Release.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "vllm-guard.selectorLabels" -}}
app.kubernetes.io/name: vllm-guard
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "vllm-guard.labels" -}}
{{ include "vllm-guard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "vllm-guard.saltKeySecret" -}}
{{- .Values.saltKey.existingSecret | default (printf "%s-salt-key" (include "vllm-guard.fullname" .)) -}}
{{- end -}}

{{- /* A salt key given the gateway's own way, config.guard.salt_reuse.key: "" if none. */ -}}
{{- define "vllm-guard.configSaltKey" -}}
{{- $guard := (.Values.config | default dict).guard | default dict -}}
{{- ($guard.salt_reuse | default dict).key | default "" -}}
{{- end -}}

{{- define "vllm-guard.config" -}}
{{- $config := deepCopy .Values.config -}}
{{- $guard := get $config "guard" | default dict -}}
{{- $saltReuse := get $guard "salt_reuse" | default dict -}}
{{- if hasKey $saltReuse "key" -}}
{{- /* The key goes to the chart's Secret (secret.yaml), never into the ConfigMap. */ -}}
{{- $_ := unset $saltReuse "key" -}}
{{- if not $saltReuse -}}{{- $_ := unset $guard "salt_reuse" -}}{{- end -}}
{{- end -}}
{{- $server := get $config "server" | default dict -}}
{{- $_ := set $server "shutdown_grace_s" .Values.shutdownGraceSeconds -}}
{{- $_ := set $config "server" $server -}}
{{- $metrics := get $config "metrics" | default dict -}}
{{- if and $metrics.port (not $metrics.host) -}}
{{- /* metrics.host defaults to 127.0.0.1, which no scrape from outside the pod reaches. */ -}}
{{- $_ := set $metrics "host" "0.0.0.0" -}}
{{- $_ := set $config "metrics" $metrics -}}
{{- end -}}
{{- if .Values.clientKeySha256 -}}
{{- $_ := set $config "auth" (dict "api_key_sha256" .Values.clientKeySha256) -}}
{{- end -}}
{{- if .Values.tracing.enabled -}}
{{- $_ := set $config "tracing" (dict "enabled" true "keep_retried" .Values.tracing.keepRetried) -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{- /* The container port /metrics is served on: `metrics` with config.metrics.port, else `http`. */ -}}
{{- define "vllm-guard.metricsPortName" -}}
{{- if (.Values.config.metrics | default dict).port -}}metrics{{- else -}}http{{- end -}}
{{- end -}}
