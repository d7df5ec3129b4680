{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "r3flow.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name; a release already named like the chart is not doubled. */}}
{{- define "r3flow.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "r3flow.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "r3flow.labels" -}}
helm.sh/chart: {{ include "r3flow.chart" . }}
{{ include "r3flow.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: r3flow
{{- end }}

{{- define "r3flow.selectorLabels" -}}
app.kubernetes.io/name: {{ include "r3flow.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component: (dict "ctx" $ "component" "store"). */}}
{{- define "r3flow.componentLabels" -}}
{{ include "r3flow.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "r3flow.componentSelector" -}}
{{ include "r3flow.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "r3flow.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "r3flow.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image of one r3flow component: (dict "ctx" $ "image" .Values.store.image). */}}
{{- define "r3flow.image" -}}
{{- $reg := .ctx.Values.global.imageRegistry -}}
{{- $tag := .image.tag | default .ctx.Chart.AppVersion -}}
{{- if .image.digest }}
{{- printf "%s/%s@%s" $reg .image.repository .image.digest }}
{{- else }}
{{- printf "%s/%s:%s" $reg .image.repository $tag }}
{{- end }}
{{- end }}

{{- define "r3flow.storeHost" -}}
{{ include "r3flow.fullname" . }}-store
{{- end }}

{{- define "r3flow.storeAddress" -}}
{{ include "r3flow.storeHost" . }}:{{ .Values.store.service.grpcPort }}
{{- end }}

{{- define "r3flow.redisHost" -}}
{{ include "r3flow.fullname" . }}-redis
{{- end }}

{{/* Secret that holds the Redis password (chart-made or the user's). */}}
{{- define "r3flow.redisSecretName" -}}
{{- .Values.redis.auth.existingSecret | default (printf "%s-redis" (include "r3flow.fullname" .)) }}
{{- end }}

{{/* Env that builds REDIS_URL for the store: in-cluster (password from the Secret) or external. */}}
{{- define "r3flow.redisEnv" -}}
{{- if .Values.redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "r3flow.redisSecretName" . }}
      key: {{ .Values.redis.auth.existingSecretKey }}
- name: REDIS_URL
  value: "redis://:$(REDIS_PASSWORD)@{{ include "r3flow.redisHost" . }}:{{ .Values.redis.port }}/0"
{{- else }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret | default (printf "%s-redis-url" (include "r3flow.fullname" .)) }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- end }}
{{- end }}

{{/* Pod-level security context shared by every r3flow pod. */}}
{{- define "r3flow.podSecurityContext" -}}
{{ toYaml .Values.podSecurityContext }}
{{- end }}

{{- define "r3flow.securityContext" -}}
{{ toYaml .Values.securityContext }}
{{- end }}

{{/* A component config file rendered from values; values may use templates (e.g. the store address). */}}
{{- define "r3flow.configFile" -}}
{{ tpl (toYaml .config) .ctx }}
{{- end }}

{{/* The read-only model + dataset volume of rollout and trainer pods: the user's PVC or the
     chart-made one `model.download.uri` fills. Neither = a render error, never an empty volume. */}}
{{- define "r3flow.modelClaim" -}}
{{- if .Values.model.existingClaim }}
{{- .Values.model.existingClaim }}
{{- else if .Values.model.download.uri }}
{{- include "r3flow.fullname" . }}-model
{{- else }}
{{- fail "model: set model.existingClaim (a PVC holding the model) or model.download.uri (hf://ORG/REPO, s3://..., gs://...)" }}
{{- end }}
{{- end }}

{{- define "r3flow.modelVolume" -}}
- name: models
  persistentVolumeClaim:
    claimName: {{ include "r3flow.modelClaim" . }}
    readOnly: {{ not .Values.model.download.uri }}
{{- end }}

{{/* Init container that fetches model.download.uri into the model PVC (no-op once done). */}}
{{- define "r3flow.modelFetch" -}}
{{- $ctx := .ctx -}}
{{- if and $ctx.Values.model.download.uri (not $ctx.Values.model.existingClaim) }}
- name: model-fetch
  image: {{ include "r3flow.image" (dict "ctx" $ctx "image" .image) }}
  command: [r3flow]
  args: [model, fetch, --uri, {{ $ctx.Values.model.download.uri | quote }}, --out, {{ $ctx.Values.model.path | quote }}]
  terminationMessagePolicy: FallbackToLogsOnError
  env:
    - name: HOME
      value: /tmp
  {{- with $ctx.Values.model.download.envFromSecret }}
  envFrom:
    - secretRef:
        name: {{ . }}
  {{- end }}
  securityContext:
    {{- include "r3flow.securityContext" $ctx | nindent 4 }}
  resources:
    requests: {cpu: "1", memory: 2Gi}
    limits: {cpu: "2", memory: 2Gi}
  volumeMounts:
    - name: models
      mountPath: /models
    - name: tmp
      mountPath: /tmp
{{- $dataset := get $ctx.Values.rollout.config "dataset" | default "" }}
{{- if and .dataset $ctx.Values.model.download.datasetUri }}
{{- /* The prompts too (rollout pods): a directory fetched next to the model. */}}
- name: dataset-fetch
  image: {{ include "r3flow.image" (dict "ctx" $ctx "image" .image) }}
  command: [r3flow]
  args: [model, fetch, --uri, {{ $ctx.Values.model.download.datasetUri | quote }}, --out, {{ dir $dataset | quote }}]
  terminationMessagePolicy: FallbackToLogsOnError
  env:
    - name: HOME
      value: /tmp
  {{- with $ctx.Values.model.download.envFromSecret }}
  envFrom:
    - secretRef:
        name: {{ . }}
  {{- end }}
  securityContext:
    {{- include "r3flow.securityContext" $ctx | nindent 4 }}
  resources:
    requests: {cpu: "1", memory: 2Gi}
    limits: {cpu: "2", memory: 2Gi}
  volumeMounts:
    - name: models
      mountPath: /models
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}
{{- end }}

{{/* Fast-network additions of GPU pods (fastNetwork.*): pod-level fields. */}}
{{- define "r3flow.fastNetworkPod" -}}
{{- if .Values.fastNetwork.hostNetwork }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- end }}

{{/* Container securityContext of GPU containers: IPC_LOCK added when fastNetwork.ipcLock. */}}
{{- define "r3flow.gpuSecurityContext" -}}
{{- $sc := deepCopy .Values.securityContext }}
{{- if .Values.fastNetwork.ipcLock }}
{{- $caps := $sc.capabilities | default dict }}
{{- $_ := set $caps "add" (list "IPC_LOCK") }}
{{- $_ := set $sc "capabilities" $caps }}
{{- end }}
{{- toYaml $sc }}
{{- end }}

{{/* ---- Access control (services/common/auth.py): TLS and role tokens, mounted from Secrets. */}}
{{- define "r3flow.tokenSecretName" -}}
{{- .Values.auth.tokens.existingSecret | default (printf "%s-tokens" (include "r3flow.fullname" .)) }}
{{- end }}

{{/* The store config's `auth` section (YAML; empty when neither TLS nor tokens are on). */}}
{{- define "r3flow.storeAuthConfig" -}}
{{- with .Values.auth }}
{{- if .tls.enabled }}
tls_cert_file: /var/run/r3flow/tls/tls.crt
tls_key_file: /var/run/r3flow/tls/tls.key
tls_ca_file: /var/run/r3flow/tls/ca.crt
require_client_cert: {{ .tls.mutual }}
{{- end }}
{{- if .tokens.enabled }}
token_files:
  rollout: /var/run/r3flow/tokens/rollout
  trainer: /var/run/r3flow/tokens/trainer
{{- end }}
{{- end }}
{{- end }}

{{/* A client's `store_auth` section (YAML) for role .role. */}}
{{- define "r3flow.clientAuthConfig" -}}
{{- with .ctx.Values.auth }}
{{- if .tokens.enabled }}
token_file: /var/run/r3flow/tokens/token
{{- end }}
{{- if .tls.enabled }}
ca_file: /var/run/r3flow/tls/ca.crt
{{- if .tls.mutual }}
cert_file: /var/run/r3flow/client-tls/tls.crt
key_file: /var/run/r3flow/client-tls/tls.key
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* volumeMounts of the auth Secrets (list items). */}}
{{- define "r3flow.authMounts" -}}
{{- with .ctx.Values.auth }}
{{- if .tls.enabled }}
- name: tls
  mountPath: /var/run/r3flow/tls
  readOnly: true
{{- if and .tls.mutual (ne $.role "store") }}
- name: client-tls
  mountPath: /var/run/r3flow/client-tls
  readOnly: true
{{- end }}
{{- end }}
{{- if .tokens.enabled }}
- name: tokens
  mountPath: /var/run/r3flow/tokens
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{/* volumes of the auth Secrets: the store gets every role's token, a client only its own, and
     a client gets only ca.crt of the store's TLS Secret (never the store's key). */}}
{{- define "r3flow.authVolumes" -}}
{{- $ctx := .ctx }}
{{- with $ctx.Values.auth }}
{{- if .tls.enabled }}
- name: tls
  secret:
    secretName: {{ .tls.secretName }}
    {{- if ne $.role "store" }}
    items:
      - key: ca.crt
        path: ca.crt
    {{- end }}
{{- if and .tls.mutual (ne $.role "store") }}
- name: client-tls
  secret:
    secretName: {{ .tls.clientSecretName }}
{{- end }}
{{- end }}
{{- if .tokens.enabled }}
- name: tokens
  secret:
    secretName: {{ include "r3flow.tokenSecretName" $ctx }}
    {{- if ne $.role "store" }}
    items:
      - key: {{ $.role }}
        path: token
    {{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The checkpoint PVC of the trainer (chart's RayJob and named runs, mounted at /checkpoints):
     the user's claim or the chart-made `<fullname>-checkpoints`. */}}
{{- define "r3flow.checkpointClaim" -}}
{{- .Values.trainer.checkpoints.existingClaim | default (printf "%s-checkpoints" (include "r3flow.fullname" .)) }}
{{- end }}

{{/* Secret of the Ray auth token (key auth_token): the user's or the chart-made one. */}}
{{- define "r3flow.rayTokenSecretName" -}}
{{- .Values.trainer.rayAuth.existingSecret | default (printf "%s-ray-token" (include "r3flow.fullname" .)) }}
{{- end }}

{{/* What the release's pods (and the named runs of k8s/, which mount the same names) need but
     the chart does not make, each with the command that makes it: NOTES.txt prints it, and
     tests/chart/test_quickstart.py checks that every Secret/PVC a rendered pod or a named spec
     mounts is either rendered or listed here. */}}
{{- define "r3flow.prerequisites" -}}
{{- $ns := .Release.Namespace }}
{{- $a := .Values.auth }}
{{- if $a.tls.enabled }}
# Secret {{ $a.tls.secretName }}: the store's TLS certificate (its names cover {{ include "r3flow.storeHost" . }}), key and CA
kubectl -n {{ $ns }} create secret generic {{ $a.tls.secretName }} --type=kubernetes.io/tls --from-file=tls.crt=store.crt --from-file=tls.key=store.key --from-file=ca.crt=ca.crt
{{- if $a.tls.mutual }}
# Secret {{ $a.tls.clientSecretName }}: the client certificate rollout and trainer pods present (signed by the same CA)
kubectl -n {{ $ns }} create secret generic {{ $a.tls.clientSecretName }} --type=kubernetes.io/tls --from-file=tls.crt=client.crt --from-file=tls.key=client.key --from-file=ca.crt=ca.crt
{{- end }}
{{- end }}
{{- if and $a.tokens.enabled $a.tokens.existingSecret }}
# Secret {{ $a.tokens.existingSecret }}: one store token per role
kubectl -n {{ $ns }} create secret generic {{ $a.tokens.existingSecret }} --from-literal=rollout="$(openssl rand -hex 24)" --from-literal=trainer="$(openssl rand -hex 24)"
{{- end }}
{{- if and .Values.redis.enabled .Values.redis.auth.existingSecret }}
# Secret {{ .Values.redis.auth.existingSecret }}: the Redis password
kubectl -n {{ $ns }} create secret generic {{ .Values.redis.auth.existingSecret }} --from-literal={{ .Values.redis.auth.existingSecretKey }}="$(openssl rand -hex 24)"
{{- end }}
{{- if and (not .Values.redis.enabled) .Values.redis.external.existingSecret }}
# Secret {{ .Values.redis.external.existingSecret }}: the external Redis URL
kubectl -n {{ $ns }} create secret generic {{ .Values.redis.external.existingSecret }} --from-literal={{ .Values.redis.external.existingSecretKey }}=redis://:PASSWORD@HOST:6379/0
{{- end }}
{{- if and .Values.trainer.rayAuth.enabled .Values.trainer.rayAuth.existingSecret }}
# Secret {{ .Values.trainer.rayAuth.existingSecret }}: the Ray cluster token
kubectl -n {{ $ns }} create secret generic {{ .Values.trainer.rayAuth.existingSecret }} --from-literal=auth_token="$(openssl rand -hex 24)"
{{- end }}
{{- with .Values.model.download.envFromSecret }}
# Secret {{ . }}: the model download's credentials (keys become its environment)
kubectl -n {{ $ns }} create secret generic {{ . }} --from-literal=HF_TOKEN=...
{{- end }}
{{- range .Values.imagePullSecrets }}
# Secret {{ .name }}: pulls the images
kubectl -n {{ $ns }} create secret docker-registry {{ .name }} --docker-server=REGISTRY --docker-username=USER --docker-password=TOKEN
{{- end }}
{{- if .Values.model.existingClaim }}
# PersistentVolumeClaim {{ .Values.model.existingClaim }}: holds the model at {{ .Values.model.path }} (and the prompts at /models/datasets), ReadOnlyMany or ReadWriteMany
kubectl -n {{ $ns }} create -f - <<< '{"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "{{ .Values.model.existingClaim }}"}, "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "200Gi"}}}}'
{{- end }}
{{- if .Values.trainer.checkpoints.existingClaim }}
# PersistentVolumeClaim {{ .Values.trainer.checkpoints.existingClaim }}: the trainer's checkpoints, ReadWriteMany
kubectl -n {{ $ns }} create -f - <<< '{"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "{{ .Values.trainer.checkpoints.existingClaim }}"}, "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "{{ .Values.trainer.checkpoints.size }}"}}}}'
{{- end }}
{{- end }}
