{{/* Pod template of a trainer Ray node: (dict "ctx" $ "role" "head"|"worker" "resources" R "gpus" N "shm" SIZE).
     Only the head serves /metrics (the driver runs there); rank 0, on a worker, listens on the
     weight-sync port. */}}
{{- define "r3flow.trainerPod" -}}
{{- $ctx := .ctx -}}
metadata:
  labels:
    {{- include "r3flow.componentSelector" (dict "ctx" $ctx "component" "trainer") | nindent 4 }}
  {{- with $ctx.Values.trainer.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  terminationGracePeriodSeconds: {{ $ctx.Values.trainer.terminationGracePeriodSeconds }}
  {{- if .gpus }}
  {{- include "r3flow.fastNetworkPod" $ctx | nindent 2 }}
  {{- end }}
  serviceAccountName: {{ include "r3flow.serviceAccountName" $ctx }}
  automountServiceAccountToken: false
  {{- with $ctx.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- include "r3flow.podSecurityContext" $ctx | nindent 4 }}
  {{- with include "r3flow.modelFetch" (dict "ctx" $ctx "image" $ctx.Values.trainer.image) }}
  initContainers:
    {{- . | nindent 4 }}
  {{- end }}
  containers:
    - name: ray-{{ .role }}
      image: {{ include "r3flow.image" (dict "ctx" $ctx "image" $ctx.Values.trainer.image) }}
      imagePullPolicy: {{ $ctx.Values.trainer.image.pullPolicy }}
      env:
        - name: HOME
          value: /tmp
        {{- if .gpus }}
        {{- with $ctx.Values.fastNetwork.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- end }}
        {{- with $ctx.Values.trainer.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        {{- if eq .role "head" }}
        - name: metrics
          containerPort: {{ $ctx.Values.trainer.metricsPort }}
        {{- else }}
        - name: weight-sync
          containerPort: {{ $ctx.Values.weightSync.port }}
        {{- end }}
      securityContext:
        {{- if .gpus }}
        {{- include "r3flow.gpuSecurityContext" $ctx | nindent 8 }}
        {{- else }}
        {{- include "r3flow.securityContext" $ctx | nindent 8 }}
        {{- end }}
      resources:
        requests:
          {{- toYaml .resources.requests | nindent 10 }}
          {{- if .gpus }}
          nvidia.com/gpu: {{ .gpus }}
          {{- with $ctx.Values.fastNetwork.resources }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
          {{- end }}
        limits:
          {{- toYaml .resources.limits | nindent 10 }}
          {{- if .gpus }}
          nvidia.com/gpu: {{ .gpus }}
          {{- with $ctx.Values.fastNetwork.resources }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
          {{- end }}
      volumeMounts:
        - name: config
          mountPath: /etc/r3flow
          readOnly: true
        - name: models
          mountPath: /models
          readOnly: true
        - name: checkpoints
          mountPath: /checkpoints
        - name: shm
          mountPath: /dev/shm
        - name: tmp
          mountPath: /tmp
        {{- include "r3flow.authMounts" (dict "ctx" $ctx "role" "trainer") | nindent 8 }}
  volumes:
    {{- include "r3flow.modelVolume" $ctx | nindent 4 }}
    - name: checkpoints
      persistentVolumeClaim:
        claimName: {{ include "r3flow.checkpointClaim" $ctx }}
    - name: config
      configMap:
        name: {{ include "r3flow.fullname" $ctx }}-trainer
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ .shm }}
    - name: tmp
      emptyDir: {}
    {{- include "r3flow.authVolumes" (dict "ctx" $ctx "role" "trainer") | nindent 4 }}
  {{- $sel := $ctx.Values.trainer.nodeSelector }}
  {{- $tol := $ctx.Values.trainer.tolerations }}
  {{- if eq .role "head" }}
  {{- if not (kindIs "invalid" $ctx.Values.trainer.head.nodeSelector) }}{{ $sel = $ctx.Values.trainer.head.nodeSelector }}{{ end }}
  {{- if not (kindIs "invalid" $ctx.Values.trainer.head.tolerations) }}{{ $tol = $ctx.Values.trainer.head.tolerations }}{{ end }}
  {{- end }}
  {{- with $sel }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $tol }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
