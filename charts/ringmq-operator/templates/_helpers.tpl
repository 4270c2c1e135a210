{{- define "ringmq-operator.name" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ringmq-operator.labels" -}}
app.kubernetes.io/name: ringmq-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "ringmq-operator.selector" -}}
app.kubernetes.io/name: ringmq-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
