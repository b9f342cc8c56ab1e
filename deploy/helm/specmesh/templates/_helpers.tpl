{{/*
Names, labels and the pieces shared by the three tier Deployments.
*/}}

{{- define "specmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name, kept short enough that "<fullname>-orchestrator"
still fits a 63-character DNS label.
*/}}
{{- define "specmesh.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specmesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The tiers, in the order their resources are rendered. */}}
{{- define "specmesh.tiers" -}}
orchestrator draft verifier
{{- end }}

{{/* Tiers with an HPA and a PDB: the three above, and the HTTP gateway when enabled. */}}
{{- define "specmesh.scaledTiers" -}}
{{ include "specmesh.tiers" . }}{{ if .Values.gateway.enabled }} gateway{{ end }}
{{- end }}

{{/* The gateway dials the orchestrator Service (or gateway.orchestratorAddr). */}}
{{- define "specmesh.gatewayUpstream" -}}
{{- if .Values.gateway.orchestratorAddr -}}
{{- .Values.gateway.orchestratorAddr -}}
{{- else -}}
{{- printf "%s:%v" (include "specmesh.tierName" (dict "root" . "tier" "orchestrator")) .Values.orchestrator.service.port -}}
{{- end -}}
{{- end }}

{{/* gRPC service name each tier reports through grpc.health.v1. */}}
{{- define "specmesh.grpcService" -}}
{{- $m := dict "orchestrator" "specmesh.v1.Orchestrator" "draft" "specmesh.v1.Draft" "verifier" "specmesh.v1.Verifier" -}}
{{- required (printf "unknown tier %q" .) (get $m .) -}}
{{- end }}

{{/* Resource name of a tier: dict "root" $ "tier" "draft" */}}
{{- define "specmesh.tierName" -}}
{{- printf "%s-%s" (include "specmesh.fullname" .root) .tier }}
{{- end }}

{{- define "specmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "specmesh.labels" -}}
helm.sh/chart: {{ include "specmesh.chart" . }}
{{ include "specmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specmesh
{{- end }}

{{/* dict "root" $ "tier" "draft" */}}
{{- define "specmesh.tierSelectorLabels" -}}
{{ include "specmesh.selectorLabels" .root }}
app.kubernetes.io/component: {{ .tier }}
{{- end }}

{{- define "specmesh.tierLabels" -}}
{{ include "specmesh.labels" .root }}
app.kubernetes.io/component: {{ .tier }}
{{- end }}

{{- define "specmesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specmesh.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image of a tier: the tier's `image` overrides the top-level one. */}}
{{- define "specmesh.image" -}}
{{- $root := .root -}}
{{- $img := merge (deepCopy (default dict (index $root.Values .tier).image)) (deepCopy $root.Values.image) -}}
{{- $tag := default $root.Chart.AppVersion $img.tag -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (toString $tag) -}}
{{- end -}}
{{- end }}

{{- define "specmesh.imagePullPolicy" -}}
{{- $root := .root -}}
{{- default $root.Values.image.pullPolicy (default dict (index $root.Values .tier).image).pullPolicy -}}
{{- end }}

{{/* host:port lists the orchestrator dials. */}}
{{- define "specmesh.draftAddrs" -}}
{{- if .Values.orchestrator.draftAddrs -}}
{{- .Values.orchestrator.draftAddrs -}}
{{- else -}}
{{- printf "%s:%v" (include "specmesh.tierName" (dict "root" . "tier" "draft")) .Values.draft.service.port -}}
{{- end -}}
{{- end }}

{{- define "specmesh.verifierAddrs" -}}
{{- if .Values.orchestrator.verifierAddrs -}}
{{- .Values.orchestrator.verifierAddrs -}}
{{- else -}}
{{- printf "%s:%v" (include "specmesh.tierName" (dict "root" . "tier" "verifier")) .Values.verifier.service.port -}}
{{- end -}}
{{- end }}

{{/* Redis ----------------------------------------------------------------- */}}

{{- define "specmesh.redis.fullname" -}}
{{- printf "%s-redis" (include "specmesh.fullname" .) }}
{{- end }}

{{/* REDIS_URL, without the password (that travels as REDIS_PASSWORD). */}}
{{- define "specmesh.redis.url" -}}
{{- if .Values.redis.enabled -}}
{{- if .Values.externalRedis.url -}}
{{- fail "externalRedis.url is set but redis.enabled is true: set redis.enabled=false to use an external Redis" -}}
{{- end -}}
{{- printf "redis://%s:%v/%v" (include "specmesh.redis.fullname" .) .Values.redis.port .Values.redis.database -}}
{{- else -}}
{{- required "redis.enabled is false: set externalRedis.url (e.g. redis://redis.example:6379/0)" .Values.externalRedis.url -}}
{{- end -}}
{{- end }}

{{/* Name of the Secret holding the Redis password; empty when there is none. */}}
{{- define "specmesh.redis.secretName" -}}
{{- if .Values.redis.enabled -}}
{{- if .Values.redis.auth.existingSecret -}}
{{- .Values.redis.auth.existingSecret -}}
{{- else if or .Values.redis.auth.password .Values.redis.auth.enabled -}}
{{- include "specmesh.redis.fullname" . -}}
{{- end -}}
{{- else -}}
{{- if .Values.externalRedis.existingSecret -}}
{{- .Values.externalRedis.existingSecret -}}
{{- else if .Values.externalRedis.password -}}
{{- printf "%s-external-redis" (include "specmesh.fullname" .) -}}
{{- end -}}
{{- end -}}
{{- end }}

{{- define "specmesh.redis.secretKey" -}}
{{- if .Values.redis.enabled -}}
{{- if .Values.redis.auth.existingSecret -}}{{ .Values.redis.auth.existingSecretPasswordKey }}{{- else -}}redis-password{{- end -}}
{{- else -}}
{{- if .Values.externalRedis.existingSecret -}}{{ .Values.externalRedis.existingSecretPasswordKey }}{{- else -}}redis-password{{- end -}}
{{- end -}}
{{- end }}

{{/* Environment --------------------------------------------------------- */}}

{{/* Env shared by every tier: dict "root" $ "tier" "draft" */}}
{{- define "specmesh.commonEnv" -}}
{{- $root := .root -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: SPECMESH_METRICS_PORT
  value: {{ $root.Values.metrics.port | quote }}
- name: SPECMESH_LOG_FORMAT
  value: {{ $root.Values.logFormat | quote }}
- name: SPECMESH_CACHE_DIR
  value: {{ $root.Values.cache.mountPath | quote }}
- name: HF_HOME
  value: {{ printf "%s/hf" $root.Values.cache.mountPath | quote }}
- name: HF_HUB_OFFLINE
  value: {{ ternary "1" "0" $root.Values.huggingface.offline | quote }}
{{- if $root.Values.huggingface.tokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.huggingface.tokenSecret.name }}
      key: {{ $root.Values.huggingface.tokenSecret.key }}
{{- end }}
# Writable scratch for libraries that cache under $HOME (read-only root fs).
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: TRITON_CACHE_DIR
  value: /tmp/.triton
- name: OTEL_SERVICE_NAME
  value: {{ printf "specmesh-%s" .tier | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),service.namespace={{ $root.Release.Namespace }}"
{{- if $root.Values.tracing.otlpEndpoint }}
- name: OTEL_TRACES_EXPORTER
  value: otlp
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $root.Values.tracing.otlpEndpoint | quote }}
- name: OTEL_TRACES_SAMPLER
  value: parentbased_traceidratio
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $root.Values.tracing.samplerRatio | quote }}
{{- end }}
{{- with $root.Values.commonEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
A tier Deployment. Call with
  dict "root" $ "tier" "verifier" "env" (include "..." $) "gpu" 1
where env is a YAML list of the tier's own EnvVars. Only the verifier may pass
a non-zero gpu; no other tier may request the GPU resource in its resources.
*/}}
{{- define "specmesh.deployment" -}}
{{- $root := .root -}}
{{- $tier := .tier -}}
{{- $tv := index $root.Values $tier -}}
{{- $name := include "specmesh.tierName" (dict "root" $root "tier" $tier) -}}
{{- $gpuName := $root.Values.verifier.gpuResourceName -}}
{{- $res := deepCopy (default dict $tv.resources) -}}
{{- if ne $tier "verifier" -}}
{{- if or (hasKey (default dict $res.limits) $gpuName) (hasKey (default dict $res.requests) $gpuName) -}}
{{- fail (printf "%s.resources requests %s: only the verifier tier may use GPUs (set verifier.gpu)" $tier $gpuName) -}}
{{- end -}}
{{- else if gt (int (default 0 .gpu)) 0 -}}
{{- $limits := deepCopy (default dict $res.limits) -}}
{{- $_ := set $limits $gpuName (int .gpu) -}}
{{- $_ := set $res "limits" $limits -}}
{{- $requests := deepCopy (default dict $res.requests) -}}
{{- $_ := set $requests $gpuName (int .gpu) -}}
{{- $_ := set $res "requests" $requests -}}
{{- end -}}
{{- $grpcService := include "specmesh.grpcService" $tier -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specmesh.tierLabels" (dict "root" $root "tier" $tier) | nindent 4 }}
spec:
  {{- if not $tv.autoscaling.enabled }}
  replicas: {{ $tv.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  {{- with $tv.strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "specmesh.tierSelectorLabels" (dict "root" $root "tier" $tier) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "specmesh.tierLabels" (dict "root" $root "tier" $tier) | nindent 8 }}
        {{- with $tv.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        kubectl.kubernetes.io/default-container: {{ $tier }}
        {{- with .checksum }}
        checksum/secret: {{ . }}
        {{- end }}
        {{- with $tv.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "specmesh.serviceAccountName" $root }}
      automountServiceAccountToken: {{ $root.Values.serviceAccount.automount }}
      enableServiceLinks: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $tv.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $tv.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      terminationGracePeriodSeconds: {{ $tv.terminationGracePeriodSeconds }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- if $root.Values.cache.seedFromImage }}
      initContainers:
        # Copies weights baked into the image (BAKE_MODEL) into the writable
        # cache volume; does nothing for images built without them.
        - name: seed-cache
          image: {{ include "specmesh.image" (dict "root" $root "tier" $tier) | quote }}
          imagePullPolicy: {{ include "specmesh.imagePullPolicy" (dict "root" $root "tier" $tier) }}
          command:
            - sh
            - -c
            - |
              if [ -d /opt/specmesh/cache ] && [ -n "$(ls -A /opt/specmesh/cache 2>/dev/null)" ]; then
                cp -R /opt/specmesh/cache/. {{ $root.Values.cache.mountPath }}/ && echo "seeded the model cache from the image"
              fi
          resources:
            requests:
              cpu: 50m
              memory: 64Mi
            limits:
              memory: 256Mi
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            - name: cache
              mountPath: {{ $root.Values.cache.mountPath }}
      {{- end }}
      containers:
        - name: {{ $tier }}
          image: {{ include "specmesh.image" (dict "root" $root "tier" $tier) | quote }}
          imagePullPolicy: {{ include "specmesh.imagePullPolicy" (dict "root" $root "tier" $tier) }}
          command: ["specmesh", "serve", {{ $tier | quote }}]
          {{- with $tv.extraArgs }}
          args:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $tv.port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $root.Values.metrics.port }}
              protocol: TCP
          env:
            - name: SPECMESH_PORT
              value: {{ $tv.port | quote }}
            {{- include "specmesh.commonEnv" (dict "root" $root "tier" $tier) | nindent 12 }}
            {{- with .env }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- include "specmesh.securityEnv" (dict "root" $root "tier" $tier) | nindent 12 }}
            {{- include "specmesh.settingsEnv" $tv | nindent 12 }}
            {{- with $tv.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- with $tv.extraEnvFrom }}
          envFrom:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          # NOT_SERVING until the model is loaded: the startup probe covers
          # loading, readiness gates traffic (and flips during SIGTERM
          # draining), liveness only asks whether the server answers.
          startupProbe:
            {{- include "specmesh.grpcProbe" (dict "root" $root "tier" $tier "service" $grpcService) | nindent 12 }}
            periodSeconds: {{ $tv.probes.startup.periodSeconds }}
            timeoutSeconds: 5
            failureThreshold: {{ $tv.probes.startup.failureThreshold }}
          readinessProbe:
            {{- include "specmesh.grpcProbe" (dict "root" $root "tier" $tier "service" $grpcService) | nindent 12 }}
            periodSeconds: {{ $tv.probes.readiness.periodSeconds }}
            timeoutSeconds: {{ $tv.probes.readiness.timeoutSeconds }}
            failureThreshold: {{ $tv.probes.readiness.failureThreshold }}
          livenessProbe:
            {{- include "specmesh.grpcProbe" (dict "root" $root "tier" $tier "service" "") | nindent 12 }}
            periodSeconds: {{ $tv.probes.liveness.periodSeconds }}
            timeoutSeconds: {{ $tv.probes.liveness.timeoutSeconds }}
            failureThreshold: {{ $tv.probes.liveness.failureThreshold }}
          {{- with $tv.preStopSleepSeconds }}
          # Keep serving while the endpoint is removed from the Services;
          # SIGTERM (drain, NOT_SERVING) follows.
          lifecycle:
            preStop:
              exec:
                command: ["sleep", {{ . | quote }}]
          {{- end }}
          {{- with $res }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            - name: cache
              mountPath: {{ $root.Values.cache.mountPath }}
            {{- if $root.Values.models.existingClaim }}
            - name: models
              mountPath: {{ $root.Values.models.mountPath }}
              readOnly: {{ $root.Values.models.readOnly }}
              {{- with $root.Values.models.subPath }}
              subPath: {{ . }}
              {{- end }}
            {{- end }}
            {{- include "specmesh.securityVolumeMounts" (dict "root" $root "tier" $tier) | nindent 12 }}
            {{- with $tv.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir:
            sizeLimit: {{ $root.Values.tmpSizeLimit }}
        - name: cache
          {{- if $root.Values.cache.existingClaim }}
          persistentVolumeClaim:
            claimName: {{ $root.Values.cache.existingClaim }}
          {{- else }}
          emptyDir:
            {{- with $root.Values.cache.emptyDir.medium }}
            medium: {{ . }}
            {{- end }}
            {{- with $root.Values.cache.emptyDir.sizeLimit }}
            sizeLimit: {{ . }}
            {{- end }}
          {{- end }}
        {{- if $root.Values.models.existingClaim }}
        - name: models
          persistentVolumeClaim:
            claimName: {{ $root.Values.models.existingClaim }}
            readOnly: {{ $root.Values.models.readOnly }}
        {{- end }}
        {{- include "specmesh.securityVolumes" (dict "root" $root "tier" $tier) | nindent 8 }}
        {{- with $tv.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $tv.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $selector := include "specmesh.tierSelectorLabels" (dict "root" $root "tier" $tier) | fromYaml }}
      {{- if $tv.affinity }}
      affinity:
        {{- toYaml $tv.affinity | nindent 8 }}
      {{- else if $tv.podAntiAffinityPreset }}
      {{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" $selector) }}
      affinity:
        podAntiAffinity:
          {{- if eq $tv.podAntiAffinityPreset "hard" }}
          requiredDuringSchedulingIgnoredDuringExecution:
            {{- toYaml (list $term) | nindent 12 }}
          {{- else if eq $tv.podAntiAffinityPreset "soft" }}
          preferredDuringSchedulingIgnoredDuringExecution:
            {{- toYaml (list (dict "weight" 100 "podAffinityTerm" $term)) | nindent 12 }}
          {{- else }}
          {{- fail (printf "%s.podAntiAffinityPreset must be \"\", \"soft\" or \"hard\"" $tier) }}
          {{- end }}
      {{- end }}
      {{- with $tv.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $tv.topologySpreadConstraints }}
      {{- $spread := list }}
      {{- range . }}
      {{- $c := deepCopy . }}
      {{- if not (hasKey $c "labelSelector") }}
      {{- $_ := set $c "labelSelector" (dict "matchLabels" $selector) }}
      {{- end }}
      {{- $spread = append $spread $c }}
      {{- end }}
      topologySpreadConstraints:
        {{- toYaml $spread | nindent 8 }}
      {{- end }}
{{- end }}

{{/* A tier Service exposing gRPC and metrics: dict "root" $ "tier" "draft" */}}
{{- define "specmesh.service" -}}
{{- $root := .root -}}
{{- $tier := .tier -}}
{{- $tv := index $root.Values $tier -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "specmesh.tierName" (dict "root" $root "tier" $tier) }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specmesh.tierLabels" (dict "root" $root "tier" $tier) | nindent 4 }}
  {{- with $tv.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: {{ $tv.service.type }}
  {{- if and (eq $tv.service.type "LoadBalancer") $tv.service.loadBalancerSourceRanges }}
  loadBalancerSourceRanges:
    {{- toYaml $tv.service.loadBalancerSourceRanges | nindent 4 }}
  {{- end }}
  selector:
    {{- include "specmesh.tierSelectorLabels" (dict "root" $root "tier" $tier) | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $tv.service.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    - name: metrics
      port: {{ $root.Values.metrics.port }}
      targetPort: metrics
      protocol: TCP
      appProtocol: http
{{- end }}

{{/*
<tier>.settings: any setting of specmesh/config.py by its field name (the values
schema lists them), as its environment variable. Whole numbers arrive from YAML
as floats: print them as integers, never as 4.194304e+06.
*/}}
{{- define "specmesh.settingsEnv" -}}
{{- range $name, $value := .settings }}
- name: {{ printf "SPECMESH_%s" (upper $name) }}
  value: {{ if and (kindIs "float64" $value) (eq $value (float64 (int64 $value))) }}{{ int64 $value | toString | quote }}{{ else }}{{ $value | toString | quote }}{{ end }}
{{- end }}
{{- end }}

{{/*
The bundled Redis's password: the one given, else the one already in the
release's Secret (kept across upgrades), else a new random one.
*/}}
{{- define "specmesh.redis.password" -}}
{{- if .Values.redis.auth.password -}}
{{- .Values.redis.auth.password -}}
{{- else -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "specmesh.redis.fullname" .) -}}
{{- if and $existing $existing.data (index $existing.data "redis-password") -}}
{{- index $existing.data "redis-password" | b64dec -}}
{{- else -}}
{{- randAlphaNum 32 -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/* Security ------------------------------------------------------------ */}}

{{/* The Secret holding tls.crt, tls.key and ca.crt. */}}
{{- define "specmesh.tls.secretName" -}}
{{- if .Values.tls.existingSecret -}}
{{- .Values.tls.existingSecret -}}
{{- else if .Values.tls.certManager.enabled -}}
{{- printf "%s-tls" (include "specmesh.fullname" .) -}}
{{- else -}}
{{- fail "tls.enabled needs a certificate: set tls.existingSecret, or tls.certManager.enabled with tls.certManager.issuerRef.name" -}}
{{- end -}}
{{- end }}

{{/*
TLS files and token files as each tier's settings: dict "root" $ "tier" "draft".
Every gRPC tier serves tls.crt; the draft and verifier admit only client
certificates from ca.crt (mutual TLS); the orchestrator presents tls.crt to
them and checks theirs against ca.crt; the gateway checks the orchestrator's.
*/}}
{{- define "specmesh.securityEnv" -}}
{{- $root := .root -}}
{{- $tier := .tier -}}
{{- if $root.Values.tls.enabled }}
{{- $dir := $root.Values.tls.mountPath }}
{{- if ne $tier "gateway" }}
- name: SPECMESH_TLS_CERT_FILE
  value: {{ printf "%s/tls.crt" $dir | quote }}
- name: SPECMESH_TLS_KEY_FILE
  value: {{ printf "%s/tls.key" $dir | quote }}
{{- end }}
{{- if has $tier (list "draft" "verifier") }}
- name: SPECMESH_TLS_CLIENT_CA_FILE
  value: {{ printf "%s/ca.crt" $dir | quote }}
{{- else }}
- name: SPECMESH_TLS_CA_FILE
  value: {{ printf "%s/ca.crt" $dir | quote }}
{{- end }}
{{- end }}
{{- if and $root.Values.auth.tokensSecret (eq $tier "orchestrator") }}
- name: SPECMESH_AUTH_TOKENS_FILE
  value: /etc/specmesh/auth/tokens
{{- end }}
{{- if and $root.Values.auth.internalTokenSecret (ne $tier "gateway") }}
- name: SPECMESH_INTERNAL_TOKEN_FILE
  value: /etc/specmesh/internal/internal-token
{{- end }}
{{- end }}

{{/* Whole-folder Secret mounts (a subPath mount would never see a rotation). */}}
{{- define "specmesh.securityVolumeMounts" -}}
{{- $root := .root -}}
{{- if $root.Values.tls.enabled }}
- name: tls
  mountPath: {{ $root.Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- if and $root.Values.auth.tokensSecret (eq .tier "orchestrator") }}
- name: auth-tokens
  mountPath: /etc/specmesh/auth
  readOnly: true
{{- end }}
{{- if and $root.Values.auth.internalTokenSecret (ne .tier "gateway") }}
- name: internal-token
  mountPath: /etc/specmesh/internal
  readOnly: true
{{- end }}
{{- end }}

{{- define "specmesh.securityVolumes" -}}
{{- $root := .root -}}
{{- if $root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "specmesh.tls.secretName" $root }}
    {{- if eq .tier "gateway" }}
    # The gateway only checks the orchestrator's certificate: no private key here.
    items:
      - key: ca.crt
        path: ca.crt
    {{- end }}
{{- end }}
{{- if and $root.Values.auth.tokensSecret (eq .tier "orchestrator") }}
- name: auth-tokens
  secret:
    secretName: {{ $root.Values.auth.tokensSecret }}
    items:
      - key: tokens
        path: tokens
{{- end }}
{{- if and $root.Values.auth.internalTokenSecret (ne .tier "gateway") }}
- name: internal-token
  secret:
    secretName: {{ $root.Values.auth.internalTokenSecret }}
    items:
      - key: internal-token
        path: internal-token
{{- end }}
{{- end }}

{{/*
A gRPC health probe's action: dict "root" $ "tier" "draft" "service" "specmesh.v1.Draft".
kubelet's own gRPC probe speaks plaintext only; with TLS the tier probes itself
with its own certificate (python -m specmesh_cli.probe).
*/}}
{{- define "specmesh.grpcProbe" -}}
{{- $tv := index .root.Values .tier -}}
{{- if .root.Values.tls.enabled -}}
exec:
  command: ["python", "-m", "specmesh_cli.probe", "--port", {{ $tv.port | quote }}, "--service", {{ .service | quote }},
            "--server-name", {{ include "specmesh.tierName" (dict "root" .root "tier" .tier) | quote }}]
{{- else -}}
grpc:
  port: {{ $tv.port }}
  service: {{ .service | quote }}
{{- end -}}
{{- end }}

{{/*
The verifier's device: verifier.device, else "cuda" when it asks for a GPU, else "cpu".
*/}}
{{- define "specmesh.verifierDevice" -}}
{{- default (ternary "cuda" "cpu" (gt (int .Values.verifier.gpu) 0)) .Values.verifier.device -}}
{{- end -}}
