{{/*
The pod template shared by the Deployment and the StatefulSet.
*/}}
{{- define "colibri.podTemplate" -}}
{{- $stateType := include "colibri.stateType" . }}
{{- $secret := include "colibri.apiKeysSecret" . }}
{{- $mirrorNames := list }}
{{- range .Values.mirrors }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" (toString .name)) }}
{{- fail (printf "mirrors: name %q must be a DNS label (lower-case letters, digits, -)" (toString .name)) }}
{{- end }}
{{- if has .name $mirrorNames }}
{{- fail (printf "mirrors: name %q is used twice" .name) }}
{{- end }}
{{- $mirrorNames = append $mirrorNames .name }}
{{- if eq (len (compact (list (.hostPath | default "") (.claimName | default "")))) 1 | not }}
{{- fail (printf "mirrors: %s needs exactly one of hostPath or claimName" .name) }}
{{- end }}
{{- if hasPrefix "/" (.dir | default "") }}
{{- fail (printf "mirrors: %s: dir is relative to the drive (found %q)" .name .dir) }}
{{- end }}
{{- end }}
{{- if .Values.modelVolume.enabled }}
{{- if not (has .Values.modelVolume.type (list "hostPath" "pvc")) }}
{{- fail (printf "modelVolume.type must be hostPath or pvc, found %q" .Values.modelVolume.type) }}
{{- end }}
{{- if and (eq .Values.modelVolume.type "pvc") (not .Values.modelVolume.pvc.claimName) }}
{{- fail "modelVolume.type pvc needs modelVolume.pvc.claimName" }}
{{- end }}
{{- end }}
{{- if .Values.modelPull.enabled }}
{{- if not .Values.modelVolume.enabled }}
{{- fail "modelPull needs modelVolume.enabled: the pull fills the model volume" }}
{{- end }}
{{- $_ := include "colibri.modelPullDir" . }}
{{- end }}
{{- if not (has .Values.lifecycle.preStopType (list "sleep" "exec")) }}
{{- fail (printf "lifecycle.preStopType must be sleep or exec, found %q" .Values.lifecycle.preStopType) }}
{{- end -}}
metadata:
  labels:
    {{- include "colibri.selectorLabels" . | nindent 4 }}
    app.kubernetes.io/component: server
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    # Roll the pods when the configuration or the API keys change.
    checksum/config: {{ include (print $.Template.BasePath "/configmap.yaml") . | sha256sum }}
    checksum/api-keys: {{ include (print $.Template.BasePath "/secret.yaml") . | sha256sum }}
    {{- if .Values.scrapeAnnotations }}
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ .Values.containerPort | int64 | quote }}
    prometheus.io/path: /metrics
    {{- end }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "colibri.serviceAccountName" . }}
  automountServiceAccountToken: false
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ include "colibri.terminationGracePeriod" . }}
  {{- with .Values.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if .Values.modelPull.enabled }}
  initContainers:
    # Fills the model volume once: `coli pull` returns at once, without the network, when
    # the volume holds a complete receipt (DIR/coli-pull.json) of this repo@revision and
    # these patterns; otherwise it downloads (resuming what an earlier try left), verifies
    # every file against the Hub's hashes and writes the receipt last.
    - name: model-pull
      image: {{ include "colibri.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command: ["coli"]
      args:
        - pull
        - {{ printf "%s@%s" .Values.modelPull.repo (.Values.modelPull.revision | default "main") | quote }}
        - --to
        - {{ include "colibri.modelPullDir" . | quote }}
        - --jobs
        - {{ .Values.modelPull.jobs | int64 | quote }}
        {{- range .Values.modelPull.include }}
        - --include
        - {{ . | quote }}
        {{- end }}
      env:
        - name: HOME
          value: /tmp
        # No token file from elsewhere: the token is the Secret's, or none.
        - name: HF_HOME
          value: /tmp/huggingface
        - name: NO_COLOR
          value: "1"
        {{- with .Values.modelPull.endpoint }}
        - name: HF_ENDPOINT
          value: {{ . | quote }}
        {{- end }}
        {{- with .Values.modelPull.tokenSecret.name }}
        - name: HF_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $.Values.modelPull.tokenSecret.key }}
        {{- end }}
      {{- with .Values.modelPull.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        # Writable for this container only; the server's mount below is read-only.
        - name: models
          mountPath: /models
        - name: tmp
          mountPath: /tmp
  {{- end }}
  containers:
    - name: colibri
      image: {{ include "colibri.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      {{- with .Values.command }}
      command:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      args:
        - serve
        - --config
        - /etc/colibri/colibri.toml
        {{- with .Values.profile }}
        - --profile
        - {{ . | quote }}
        {{- end }}
        {{- with .Values.extraArgs }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: http
          containerPort: {{ int64 .Values.containerPort }}
          protocol: TCP
      env:
        - name: COLI_STATE_DIR
          value: /var/lib/colibri
        - name: COLI_CACHE_DIR
          value: /var/cache/colibri
        - name: HOME
          value: /tmp
        {{- with $secret }}
        - name: COLI_API_KEYS
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $.Values.apiKeys.secretKey }}
        {{- end }}
        {{- with .Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- $resources := deepCopy (.Values.resources | default dict) }}
      {{- if .Values.gpu.enabled }}
      {{- $limits := get $resources "limits" | default dict }}
      {{- $_ := set $limits .Values.gpu.resourceName (int64 .Values.gpu.count) }}
      {{- $_ := set $resources "limits" $limits }}
      {{- end }}
      {{- with $resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if .Values.probes.startup.enabled }}
      startupProbe:
        httpGet:
          path: /ready
          port: http
          scheme: {{ include "colibri.probeScheme" . }}
        periodSeconds: {{ int64 .Values.probes.startup.periodSeconds }}
        timeoutSeconds: {{ int64 .Values.probes.startup.timeoutSeconds }}
        # budgetSeconds / periodSeconds: the time a model load may take before a restart.
        failureThreshold: {{ divf .Values.probes.startup.budgetSeconds .Values.probes.startup.periodSeconds | ceil | int64 }}
      {{- end }}
      {{- if .Values.probes.readiness.enabled }}
      readinessProbe:
        httpGet:
          path: /ready
          port: http
          scheme: {{ include "colibri.probeScheme" . }}
        periodSeconds: {{ int64 .Values.probes.readiness.periodSeconds }}
        timeoutSeconds: {{ int64 .Values.probes.readiness.timeoutSeconds }}
        failureThreshold: {{ int64 .Values.probes.readiness.failureThreshold }}
        successThreshold: {{ int64 .Values.probes.readiness.successThreshold }}
      {{- end }}
      {{- if .Values.probes.liveness.enabled }}
      livenessProbe:
        httpGet:
          path: /health
          port: http
          scheme: {{ include "colibri.probeScheme" . }}
        periodSeconds: {{ int64 .Values.probes.liveness.periodSeconds }}
        timeoutSeconds: {{ int64 .Values.probes.liveness.timeoutSeconds }}
        failureThreshold: {{ int64 .Values.probes.liveness.failureThreshold }}
      {{- end }}
      {{- if gt (int64 .Values.lifecycle.preStopSleepSeconds) 0 }}
      lifecycle:
        preStop:
          {{- if eq .Values.lifecycle.preStopType "sleep" }}
          sleep:
            seconds: {{ int64 .Values.lifecycle.preStopSleepSeconds }}
          {{- else }}
          exec:
            command: ["sleep", "{{ int64 .Values.lifecycle.preStopSleepSeconds }}"]
          {{- end }}
      {{- end }}
      volumeMounts:
        - name: config
          mountPath: /etc/colibri
          readOnly: true
        - name: state
          mountPath: /var/lib/colibri
        - name: cache
          mountPath: /var/cache/colibri
        - name: tmp
          mountPath: /tmp
        {{- if .Values.modelVolume.enabled }}
        - name: models
          mountPath: /models
          readOnly: true
        {{- end }}
        {{- range .Values.mirrors }}
        - name: mirror-{{ .name }}
          mountPath: /mirrors/{{ .name }}
          readOnly: true
        {{- end }}
        {{- with .Values.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "colibri.fullname" . }}
    {{- if eq $stateType "emptyDir" }}
    - name: state
      emptyDir:
        {{- with .Values.state.emptyDir.sizeLimit }}
        sizeLimit: {{ . }}
        {{- end }}
    {{- else if eq $stateType "pvc" }}
    - name: state
      persistentVolumeClaim:
        claimName: {{ .Values.state.pvc.existingClaim | default (printf "%s-state" (include "colibri.fullname" .)) }}
    {{- end }}
    - name: cache
      emptyDir:
        sizeLimit: {{ .Values.cache.sizeLimit }}
    - name: tmp
      emptyDir:
        sizeLimit: {{ .Values.tmp.sizeLimit }}
    {{- if .Values.modelVolume.enabled }}
    - name: models
      {{- if eq .Values.modelVolume.type "hostPath" }}
      hostPath:
        path: {{ .Values.modelVolume.hostPath.path }}
        {{- with .Values.modelVolume.hostPath.type }}
        type: {{ . }}
        {{- end }}
      {{- else }}
      persistentVolumeClaim:
        claimName: {{ .Values.modelVolume.pvc.claimName }}
        {{- /* A read-only claim is read-only in every container: the pull writes to it. */}}
        readOnly: {{ not .Values.modelPull.enabled }}
      {{- end }}
    {{- end }}
    {{- range .Values.mirrors }}
    - name: mirror-{{ .name }}
      {{- if .hostPath }}
      hostPath:
        path: {{ .hostPath }}
        type: Directory
      {{- else }}
      persistentVolumeClaim:
        claimName: {{ .claimName }}
        readOnly: true
      {{- end }}
    {{- end }}
    {{- with .Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
