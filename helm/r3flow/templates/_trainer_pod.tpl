{{/* Pod template of a trainer Ray node: (dict "ctx" $ "role" "head"|"worker" "resources" R "gpus" N "shm" SIZE). */}}
{{- define "r3flow.trainerPod" -}}
{{- $ctx := .ctx -}}
metadata:
  labels:
    {{- include "r3flow.componentSelector" (dict "ctx" $ctx "component" "trainer") | nindent 4 }}
spec:
  serviceAccountName: {{ include "r3flow.serviceAccountName" $ctx }}
  automountServiceAccountToken: false
  {{- with $ctx.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- include "r3flow.podSecurityContext" $ctx | nindent 4 }}
  containers:
    - name: ray-{{ .role }}
      image: {{ include "r3flow.image" (dict "ctx" $ctx "image" $ctx.Values.trainer.image) }}
      imagePullPolicy: {{ $ctx.Values.trainer.image.pullPolicy }}
      env:
        - name: HOME
          value: /tmp
        {{- with $ctx.Values.trainer.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: metrics
          containerPort: {{ $ctx.Values.trainer.metricsPort }}
      securityContext:
        {{- include "r3flow.securityContext" $ctx | nindent 8 }}
      resources:
        requests:
          {{- toYaml .resources.requests | nindent 10 }}
          {{- if .gpus }}
          nvidia.com/gpu: {{ .gpus }}
          {{- end }}
        limits:
          {{- toYaml .resources.limits | nindent 10 }}
          {{- if .gpus }}
          nvidia.com/gpu: {{ .gpus }}
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
      {{- with $ctx.Values.trainer.checkpoints.existingClaim }}
      persistentVolumeClaim:
        claimName: {{ . }}
      {{- else }}
      emptyDir: {}
      {{- end }}
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
  {{- with $ctx.Values.trainer.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if .gpus }}
  {{- with $ctx.Values.trainer.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- end }}
{{- end }}
