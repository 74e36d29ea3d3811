{{/*
The chart name, truncated to 63 characters (a DNS label).
*/}}
{{- define "colibri.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name: RELEASE-NAME, or RELEASE when the release name already contains the chart name.
*/}}
{{- define "colibri.fullname" -}}
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

{{- define "colibri.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "colibri.selectorLabels" -}}
app.kubernetes.io/name: {{ include "colibri.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "colibri.labels" -}}
helm.sh/chart: {{ include "colibri.chart" . }}
{{ include "colibri.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: server
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "colibri.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "colibri.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "colibri.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (toString .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
The workload kind, checked.
*/}}
{{- define "colibri.kind" -}}
{{- if not (has .Values.kind (list "Deployment" "StatefulSet")) }}
{{- fail (printf "kind must be Deployment or StatefulSet, found %q" (toString .Values.kind)) }}
{{- end }}
{{- .Values.kind }}
{{- end }}

{{/*
The state volume's type with `auto` resolved, checked against the workload kind.
*/}}
{{- define "colibri.stateType" -}}
{{- $kind := include "colibri.kind" . }}
{{- $t := .Values.state.type }}
{{- if eq $t "auto" }}
{{- $t = ternary "volumeClaimTemplate" "emptyDir" (eq $kind "StatefulSet") }}
{{- end }}
{{- if not (has $t (list "emptyDir" "pvc" "volumeClaimTemplate")) }}
{{- fail (printf "state.type must be auto, emptyDir, pvc or volumeClaimTemplate, found %q" $t) }}
{{- end }}
{{- if and (eq $t "volumeClaimTemplate") (ne $kind "StatefulSet") }}
{{- fail "state.type volumeClaimTemplate needs kind: StatefulSet" }}
{{- end }}
{{- if and (eq $t "pvc") (or .Values.autoscaling.enabled (gt (int .Values.replicaCount) 1)) }}
{{- fail "state.type pvc is one claim shared by every replica, and replicas must not share a usage history: use kind: StatefulSet (one claim per replica) or emptyDir" }}
{{- end }}
{{- $t }}
{{- end }}

{{/*
The name of the Secret holding the API keys; empty when there is none.
*/}}
{{- define "colibri.apiKeysSecret" -}}
{{- if .Values.apiKeys.existingSecret }}
{{- .Values.apiKeys.existingSecret }}
{{- else if .Values.apiKeys.keys }}
{{- printf "%s-api-keys" (include "colibri.fullname" .) }}
{{- end }}
{{- end }}

{{/*
A Kubernetes memory quantity (e.g. 32Gi, 500M, 1.5Gi, 34359738368) in MiB, rounded down.
*/}}
{{- define "colibri.quantityToMiB" -}}
{{- $q := . }}
{{- if or (kindIs "float64" $q) (kindIs "int" $q) (kindIs "int64" $q) }}
{{- divf $q 1048576.0 | floor | int64 }}
{{- else }}
{{- $q = toString $q | trim }}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $q }}
{{- $suffix := trimPrefix $num $q }}
{{- $factors := dict "" 1.0 "k" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 "P" 1000000000000000.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 }}
{{- if or (not $num) (not (hasKey $factors $suffix)) }}
{{- fail (printf "cannot read the memory quantity %q (expected e.g. 32Gi, 500M or a byte count)" $q) }}
{{- end }}
{{- divf (mulf $num (get $factors $suffix)) 1048576.0 | floor | int64 }}
{{- end }}
{{- end }}

{{/*
The RAM budget: config.ram when set; else empty with config.mmap; else memory limit × fraction
when ramFromMemoryLimit is on and there is a memory limit; else empty (the server's default).
*/}}
{{- define "colibri.ram" -}}
{{- $limits := (.Values.resources | default dict).limits | default dict }}
{{- if .Values.config.ram }}
{{- .Values.config.ram }}
{{- else if .Values.config.mmap }}
{{- /* Everything memory-mapped: no budget. */}}
{{- else if and .Values.ramFromMemoryLimit.enabled (hasKey $limits "memory") }}
{{- $fraction := float64 .Values.ramFromMemoryLimit.fraction }}
{{- if or (le $fraction 0.0) (gt $fraction 1.0) }}
{{- fail (printf "ramFromMemoryLimit.fraction must be in (0, 1], found %v" $fraction) }}
{{- end }}
{{- $mib := include "colibri.quantityToMiB" (get $limits "memory") | float64 }}
{{- $ram := mulf $mib $fraction | floor | int64 }}
{{- if lt $ram 256 }}
{{- fail (printf "the RAM budget derived from the memory limit is %dM: raise resources.limits.memory" $ram) }}
{{- end }}
{{- printf "%dM" $ram }}
{{- end }}
{{- end }}

{{/*
HTTPS when the server terminates TLS itself (config.tls_cert set), else HTTP: the probes'
scheme (the kubelet does not verify the certificate) and the ServiceMonitor's.
*/}}
{{- define "colibri.probeScheme" -}}
{{- if .Values.config.tls_cert }}HTTPS{{ else }}HTTP{{ end }}
{{- end }}

{{/*
The configuration keys of `coli serve` (docs/api.md; server/src/config.rs KEYS, then the engine
options of server/src/engine_options.rs ENGINE_KEYS).
*/}}
{{- define "colibri.configKeys" -}}
model served_model_name slots context prefill_chunk prefill_budget queue_limit queue_timeout_secs max_tokens_cap host port api_keys cors_origins max_body_bytes header_timeout_secs body_timeout_secs drain_secs stay_up_on_load_failure log_level log_json otlp_endpoint otlp_protocol tls_cert tls_key history_save_secs prefix_cache_dir tool_call_format reasoning_format plain_text_messages threads ram mmap mirrors mirror_weights io io_threads direct_io cache_policy pin_budget no_learn no_prefetch mla_form kv_dtype draft draft_tokens draft_ngram_min draft_ngram_max device vram
{{- end }}

{{/*
One table of colibri.toml: `key = value` lines, joined by newlines, for a map of
configuration keys, in the order of the configuration; null values and empty lists are left out. Values are written
as JSON, which is valid TOML for strings, numbers, booleans and arrays of those.
Called with (dict "values" MAP "where" NAME "root" $).
*/}}
{{- define "colibri.tomlTable" -}}
{{- $keys := splitList " " (include "colibri.configKeys" .root) }}
{{- $managed := list "api_keys" "mirrors" "port" }}
{{- range $k, $v := .values }}
{{- if not (has $k $keys) }}
{{- fail (printf "%s: unknown configuration key %q (docs/api.md lists them)" $.where $k) }}
{{- end }}
{{- if and (has $k $managed) (not (kindIs "invalid" $v)) }}
{{- fail (printf "%s: %s is set by the chart (api_keys: apiKeys; mirrors: mirrors; port: containerPort)" $.where $k) }}
{{- end }}
{{- end }}
{{- $lines := list }}
{{- range $k := $keys }}
{{- if hasKey $.values $k }}
{{- $v := get $.values $k }}
{{- if not (or (kindIs "invalid" $v) (and (kindIs "slice" $v) (empty $v))) }}
{{- $lines = append $lines (printf "%s = %s" $k (toJson $v)) }}
{{- end }}
{{- end }}
{{- end }}
{{- join "\n" $lines }}
{{- end }}

{{/*
The mirrors' paths inside the container.
*/}}
{{- define "colibri.mirrorPaths" -}}
{{- $paths := list }}
{{- range .Values.mirrors }}
{{- $paths = append $paths (trimSuffix "/" (printf "/mirrors/%s/%s" .name (.dir | default ""))) }}
{{- end }}
{{- toJson $paths }}
{{- end }}

{{/*
terminationGracePeriodSeconds: explicit, or preStop sleep + drain_secs + 10.
*/}}
{{- define "colibri.terminationGracePeriod" -}}
{{- if not (kindIs "invalid" .Values.terminationGracePeriodSeconds) }}
{{- .Values.terminationGracePeriodSeconds | int64 }}
{{- else }}
{{- $drain := 30 }}
{{- if not (kindIs "invalid" .Values.config.drain_secs) }}
{{- $drain = int64 .Values.config.drain_secs }}
{{- end }}
{{- add (int64 .Values.lifecycle.preStopSleepSeconds) $drain 10 }}
{{- end }}
{{- end }}

{{/*
The directory `modelPull` fills: /models/DIR, DIR defaulting to the repository's NAME.
Checks the values it is built from.
*/}}
{{- define "colibri.modelPullDir" -}}
{{- $p := .Values.modelPull }}
{{- if not (regexMatch "^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$" (toString $p.repo)) }}
{{- fail (printf "modelPull.repo must be ORG/NAME, found %q" (toString $p.repo)) }}
{{- end }}
{{- $dir := $p.dir | default (last (splitList "/" $p.repo)) }}
{{- if or (not (regexMatch "^[A-Za-z0-9._-]+$" $dir)) (eq $dir ".") (eq $dir "..") }}
{{- fail (printf "modelPull.dir must be one directory name below /models, found %q" $dir) }}
{{- end }}
{{- printf "/models/%s" $dir }}
{{- end }}

{{/*
The router (values `router`): its name, labels and the nginx configuration around the shared
snippets of files/router/ (the same files docker/replicas.sh mounts into its nginx).
Its pods have their own app.kubernetes.io/name, so that the server's Services, its
PodDisruptionBudget and its workload's selector never select them.
*/}}
{{- define "colibri.routerName" -}}
{{- printf "%s-router" (include "colibri.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}

{{- define "colibri.routerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "colibri.name" . | trunc 56 | trimSuffix "-" }}-router
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "colibri.routerLabels" -}}
helm.sh/chart: {{ include "colibri.chart" . }}
{{ include "colibri.routerSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: router
app.kubernetes.io/part-of: {{ include "colibri.name" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
The replicas the router knows, as `server` lines of the upstream block: each StatefulSet pod by
its DNS name under the headless Service, re-resolved by nginx (`resolve`), so a restarted pod's
new address is picked up and a pod that is not ready (no DNS record: the headless Service does
not publish unready pods) is left out. With autoscaling, every name up to maxReplicas: those of
pods that do not exist do not resolve and get no requests.
*/}}
{{- define "colibri.routerServers" -}}
{{- $r := .Values.router }}
{{- $n := int64 .Values.replicaCount }}
{{- if .Values.autoscaling.enabled }}
{{- $n = int64 .Values.autoscaling.maxReplicas }}
{{- end }}
{{- $full := include "colibri.fullname" . }}
{{- $lines := list }}
{{- range $i := until (int $n) }}
{{- $lines = append $lines (printf "server %s-%d.%s-headless.%s.svc.%s:%d\n    resolve max_fails=%d fail_timeout=%s;" $full $i $full $.Release.Namespace $r.clusterDomain (int64 $.Values.containerPort) (int64 $r.maxFails) (toString $r.failTimeout)) }}
{{- end }}
{{- join "\n" $lines }}
{{- end }}

{{/*
The router's nginx.conf: paths under /tmp (read-only root file system, any non-root user), the
shared snippets from /etc/nginx/colibri, the upstream of the StatefulSet's pods.
*/}}
{{- define "colibri.routerNginxConf" -}}
{{- $r := .Values.router }}
{{- if ne (include "colibri.kind" .) "StatefulSet" }}
{{- fail "router.enabled needs kind: StatefulSet: the router addresses each replica by its stable DNS name under the headless Service" }}
{{- end }}
{{- if .Values.config.tls_cert }}
{{- fail "router.enabled needs plain-HTTP replicas (config.tls_cert unset): terminate TLS in front of the router" }}
{{- end }}
{{- if not (has $r.balance (list "hash" "leastConn")) }}
{{- fail (printf "router.balance must be hash or leastConn, found %q" (toString $r.balance)) }}
{{- end }}
{{- if not (has $r.fallbackKey (list "clientAddress" "requestId")) }}
{{- fail (printf "router.fallbackKey must be clientAddress or requestId, found %q" (toString $r.fallbackKey)) }}
{{- end }}
{{- if not $r.resolver }}
{{- fail "router.resolver must name the cluster's DNS service (e.g. kube-dns.kube-system.svc.cluster.local)" }}
{{- end -}}
# nginx.conf of the colibri router, rendered by the colibri chart (values `router`). The
# snippets it includes are files/router/*.conf of the chart, which docker/replicas.sh uses too.
worker_processes {{ $r.workerProcesses }};
pid /tmp/nginx.pid;
events {
    worker_connections {{ int64 $r.workerConnections }};
}
http {
    log_format colibri '$remote_addr [$time_local] "$request" $status $body_bytes_sent '
                       'rt=$request_time upstream=$upstream_addr upstream_status=$upstream_status';
    access_log /dev/stdout colibri;
    client_body_temp_path /tmp/client_body;
    proxy_temp_path /tmp/proxy;
    fastcgi_temp_path /tmp/fastcgi;
    uwsgi_temp_path /tmp/uwsgi;
    scgi_temp_path /tmp/scgi;
    # The cluster's DNS: the replicas' names are looked up again every `valid`.
    resolver {{ $r.resolver }} valid={{ $r.resolverValid }};

    include /etc/nginx/colibri/conversation-key.conf;
    # Requests with neither x-session-id nor `user` (router.fallbackKey).
    map $remote_addr $colibri_key_fallback {
        default {{ ternary "$remote_addr" "$request_id" (eq $r.fallbackKey "clientAddress") }};
    }

    upstream colibri {
        zone colibri 1m;
        {{- if eq $r.balance "hash" }}
        hash $colibri_conversation_key consistent;
        {{- else }}
        least_conn;
        {{- end }}
        {{- include "colibri.routerServers" . | nindent 8 }}
        keepalive {{ int64 $r.keepalive }};
    }

    server {
        listen {{ int64 $r.containerPort }};
        # nginx itself (the liveness probe); /ready goes to a replica like any request.
        location = /router/health {
            access_log off;
            return 200 "ok\n";
        }
        location / {
            include /etc/nginx/colibri/proxy.conf;
        }
    }
}
{{- end }}
