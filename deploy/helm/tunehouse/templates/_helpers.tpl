{{/* Names, labels and the pieces every tunehouse pod shares. */}}

{{- define "tunehouse.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tunehouse.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* selector labels of one component: include "tunehouse.selector" (list $ "api") */}}
{{- define "tunehouse.selector" -}}
app.kubernetes.io/name: {{ (index . 0).Chart.Name }}
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "tunehouse.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "tunehouse.fullname" .)) -}}
{{- end -}}

{{- define "tunehouse.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "tunehouse.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/* the image, with a tag override: include "tunehouse.image" (list $ $tag) */}}
{{- define "tunehouse.image" -}}
{{- $root := index . 0 -}}
{{- $tag := index . 1 | default $root.Values.image.tag | default $root.Chart.AppVersion -}}
{{- printf "%s:%s" $root.Values.image.repository $tag -}}
{{- end -}}

{{- define "tunehouse.databaseUrl" -}}
{{- if .Values.bundled.postgresql.enabled -}}
{{- printf "postgresql+psycopg://tunehouse:%s@%s-postgresql:5432/tunehouse" .Values.bundled.postgresql.password (include "tunehouse.fullname" .) -}}
{{- else -}}
{{- required "postgresql.url (or bundled.postgresql.enabled)" .Values.postgresql.url -}}
{{- end -}}
{{- end -}}

{{- define "tunehouse.redisBase" -}}
{{- if .Values.bundled.redis.enabled -}}
{{- printf "redis://%s-redis:6379" (include "tunehouse.fullname" .) -}}
{{- else -}}
{{- required "redis.url (or bundled.redis.enabled)" .Values.redis.url | trimSuffix "/" -}}
{{- end -}}
{{- end -}}

{{- define "tunehouse.s3Endpoint" -}}
{{- if .Values.bundled.minio.enabled -}}
{{- printf "http://%s-minio:9000" (include "tunehouse.fullname" .) -}}
{{- else -}}
{{- .Values.s3.endpoint -}}
{{- end -}}
{{- end -}}

{{/* the environment of every tunehouse container: the ConfigMap's settings and the Secret's connections */}}
{{- define "tunehouse.env" -}}
envFrom:
  - configMapRef:
      name: {{ include "tunehouse.fullname" . }}-config
env:
  - name: TUNEHOUSE_DATABASE_URL
    valueFrom: {secretKeyRef: {name: {{ include "tunehouse.secretName" . }}, key: database-url}}
  - name: TUNEHOUSE_BROKER_URL
    valueFrom: {secretKeyRef: {name: {{ include "tunehouse.secretName" . }}, key: broker-url}}
  - name: TUNEHOUSE_REDIS_URL
    valueFrom: {secretKeyRef: {name: {{ include "tunehouse.secretName" . }}, key: redis-url}}
  - name: AWS_ACCESS_KEY_ID
    valueFrom: {secretKeyRef: {name: {{ include "tunehouse.secretName" . }}, key: aws-access-key-id, optional: true}}
  - name: AWS_SECRET_ACCESS_KEY
    valueFrom: {secretKeyRef: {name: {{ include "tunehouse.secretName" . }}, key: aws-secret-access-key, optional: true}}
  - name: TUNEHOUSE_METRICS_TOKEN
    valueFrom: {secretKeyRef: {name: {{ include "tunehouse.secretName" . }}, key: metrics-token, optional: true}}
  - name: HF_TOKEN
    valueFrom: {secretKeyRef: {name: {{ include "tunehouse.secretName" . }}, key: hf-token, optional: true}}
{{- end -}}

{{/* the image runs as the unprivileged user 10001 (Dockerfile); nothing needs more */}}
{{- define "tunehouse.podSecurity" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{- define "tunehouse.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  capabilities: {drop: [ALL]}
{{- end -}}

{{/* a worker's scratch and model cache (<data dir>): the shared claim, or an emptyDir of this pod */}}
{{- define "tunehouse.dataVolume" -}}
- name: data
{{- if .Values.modelCache.persistentVolumeClaim.enabled }}
  persistentVolumeClaim:
    claimName: {{ include "tunehouse.fullname" . }}-model-cache
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{/* a Deployment of inference or Tinker workers: include "tunehouse.sideWorker" (list $ "inference") */}}
{{- define "tunehouse.sideWorker" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- $v := index $root.Values $component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "tunehouse.fullname" $root }}-{{ $component }}
  labels:
    {{- include "tunehouse.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ $component }}
spec:
  replicas: {{ $v.replicas }}
  selector:
    matchLabels:
      {{- include "tunehouse.selector" (list $root $component) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "tunehouse.selector" (list $root $component) | nindent 8 }}
    spec:
      serviceAccountName: {{ include "tunehouse.serviceAccountName" $root }}
      {{- include "tunehouse.podSecurity" $root | nindent 6 }}
      {{- with $v.nodeSelector }}
      nodeSelector: {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations: {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ $component }}
          image: {{ include "tunehouse.image" (list $root "") }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["tunehouse", "worker", "--{{ $component }}"]
          {{- include "tunehouse.env" $root | nindent 10 }}
          {{- $resources := deepCopy $v.resources }}
          {{- if gt (int $v.gpus) 0 }}
          {{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" $v.gpus) ($resources.limits | default dict)) }}
          {{- end }}
          resources: {{- toYaml $resources | nindent 12 }}
          {{- include "tunehouse.containerSecurity" $root | nindent 10 }}
          volumeMounts:
            - {name: data, mountPath: /data}
      volumes:
        {{- include "tunehouse.dataVolume" $root | nindent 8 }}
{{- end -}}
