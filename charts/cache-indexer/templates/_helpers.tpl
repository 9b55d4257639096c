{{- define "cache-indexer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's prefix of our objects, short enough that the longest suffix ("-pod-reader", 11)
     keeps every name within 63 characters. */}}
{{- define "cache-indexer.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The Service the router calls: cache-indexer-service whatever the release (service.name overrides). */}}
{{- define "cache-indexer.serviceName" -}}
{{- $name := .Values.service.name | default "cache-indexer-service" -}}
{{- if gt (len $name) 63 -}}
{{- fail (printf "service.name %q is longer than 63 characters" $name) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{- define "cache-indexer.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "cache-indexer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "cache-indexer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cache-indexer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "cache-indexer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "cache-indexer.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "cache-indexer.image" -}}
{{- $image := printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- with (.Values.global | default dict).imageRegistry -}}
{{- $image = printf "%s/%s" (trimSuffix "/" .) $image -}}
{{- end -}}
{{- $image -}}
{{- end -}}

{{/* The API port: http.port or the documented service.targetPort (both given: they must agree). */}}
{{- define "cache-indexer.apiPort" -}}
{{- $http := .Values.http.port -}}
{{- $target := .Values.service.targetPort -}}
{{- if and $http $target (ne (toString $http) (toString $target)) -}}
{{- fail (printf "http.port (%v) and service.targetPort (%v) name the same port with different values: set only one" $http $target) -}}
{{- end -}}
{{- $http | default $target | default 28080 -}}
{{- end -}}

{{- define "cache-indexer.resources" -}}
{{- $own := index .Values .component -}}
{{- toYaml (($own | default dict).resources | default .Values.resources) -}}
{{- end -}}

{{/* Bytes of a Kubernetes quantity or a size of ours: 10Gi, 4GiB, 500M, 1048576. */}}
{{- define "cache-indexer.bytes" -}}
{{- $s := toString . | trim -}}
{{- $num := regexFind "^[0-9]+" $s -}}
{{- if not $num -}}{{- fail (printf "not a size: %q" $s) -}}{{- end -}}
{{- $unit := trimPrefix $num $s | trimSuffix "B" -}}
{{- $mult := dict "" 1 "K" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "k" 1000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 -}}
{{- if not (hasKey $mult $unit) -}}{{- fail (printf "not a size: %q" $s) -}}{{- end -}}
{{- mul (atoi $num) (get $mult $unit) -}}
{{- end -}}

{{/* ingest.l1.maxBufferedBytes when not set: a quarter of the bridge container's memory limit (the
     rest is the process, libzmq's queues and the NATS client), 256MiB without a limit. */}}
{{- define "cache-indexer.bridgeBufferBytes" -}}
{{- $res := include "cache-indexer.resources" (merge (dict "component" "bridge") .) | fromYaml -}}
{{- $limit := (($res | default dict).limits | default dict).memory -}}
{{- if $limit -}}
{{- div (include "cache-indexer.bytes" $limit | atoi) 4 -}}
{{- else -}}
{{- 268435456 -}}
{{- end -}}
{{- end -}}

{{/* The bundled NATS: present, and its JetStream store large enough for the streams' reservations. */}}
{{- define "cache-indexer.checkNats" -}}
{{- if .Values.nats.enabled -}}
{{- $n := .Values.nats -}}
{{- if not (and $n.container $n.container.image $n.container.image.repository) -}}
{{- fail "nats.enabled is true but the NATS sub-chart is missing from charts/: run `helm dependency build` in the chart directory (Chart.lock pins nats 2.14.2), or set nats.enabled=false and externalNats.url" -}}
{{- end -}}
{{- $natsName := include "cache-indexer.natsFullname" . -}}
{{- if gt (len $natsName) 50 -}}
{{- fail (printf "the NATS sub-chart would name objects %q plus up to 13 characters (\"-box-contexts\"), over Kubernetes' 63: set nats.fullnameOverride to a shorter name (or use a shorter release name)" $natsName) -}}
{{- end -}}
{{- $fs := $n.config.jetstream.fileStore -}}
{{- $store := include "cache-indexer.bytes" ($fs.maxSize | default $fs.pvc.size) | atoi -}}
{{- $streams := include "cache-indexer.natsSettings" . | fromYaml -}}
{{- $l1b := ($streams.l1Stream | default dict).maxBytes | default "4GiB" -}}
{{- $l3b := ($streams.l3Stream | default dict).maxBytes | default "1GiB" -}}
{{- $l1 := include "cache-indexer.bytes" $l1b | atoi -}}
{{- $l3 := include "cache-indexer.bytes" $l3b | atoi -}}
{{- if ge (add $l1 $l3) $store -}}
{{- fail (printf "nats.l1Stream.maxBytes (%v) + nats.l3Stream.maxBytes (%v) do not fit the NATS JetStream store (nats.config.jetstream.fileStore: %v): a NATS server reserves each stream's maxBytes and refuses any new stream, the snapshot store and the lease buckets included, once nothing is left; keep the sum below the store" $l1b $l3b ($fs.maxSize | default $fs.pvc.size)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The bundled NATS chart's fullname, by its own rule (so it also holds under an umbrella chart). */}}
{{- define "cache-indexer.natsFullname" -}}
{{- $n := .Values.nats -}}
{{- $name := default "nats" $n.nameOverride -}}
{{- if $n.fullnameOverride -}}
{{- $n.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The NATS URL: the bundled sub-chart's client Service, or externalNats.url. */}}
{{- define "cache-indexer.natsUrl" -}}
{{- if .Values.nats.enabled -}}
{{- $name := include "cache-indexer.natsFullname" . -}}
{{- $urls := list (printf "nats://%s.%s.svc:4222" $name .Release.Namespace) -}}
{{- $cluster := ((.Values.nats.config | default dict).cluster | default dict) -}}
{{- if $cluster.enabled -}}
{{- /* every server of the StatefulSet too: the bundled chart does not advertise them to clients */ -}}
{{- range $i, $_ := until (int ($cluster.replicas | default 3)) -}}
{{- $urls = append $urls (printf "nats://%s-%d.%s-headless.%s.svc:4222" $name $i $name $.Release.Namespace) -}}
{{- end -}}
{{- end -}}
{{- join "," $urls -}}
{{- else if .Values.externalNats.url -}}
{{- .Values.externalNats.url -}}
{{- else -}}
{{- fail "cache-indexer needs NATS with JetStream: set nats.enabled=true (bundled NATS chart) or externalNats.url" -}}
{{- end -}}
{{- end -}}

{{- define "cache-indexer.imagePullSecrets" -}}
{{- $secrets := concat (.Values.imagePullSecrets | default list) ((.Values.global | default dict).imagePullSecrets | default list) -}}
{{- with $secrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "cache-indexer.podMeta" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- include "cache-indexer.imagePullSecrets" . }}
{{- end -}}

{{/* Merged into the NATS sub-chart's containers (rendered in its context, through its $tplYaml):
     global.imageRegistry for the image, nats.resources.<part> (nats, reloader, natsBox), and a Pod
     Security "restricted" securityContext. */}}
{{- define "cache-indexer.natsContainer" -}}
{{- $g := .root.Values.global | default dict -}}
{{- if and $g.imageRegistry (not .image.registry) (not ($g.image | default dict).registry) (not .image.fullImageName) }}
image: {{ printf "%s/%s:%s" (trimSuffix "/" $g.imageRegistry) .image.repository (toString .image.tag) }}
{{- end }}
{{- with index (.root.Values.resources | default dict) .part }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if and (eq .part "nats") .root.Values.timerSlackUs }}
{{- /* nats.timerSlackUs: a process may set its own timer slack unprivileged; exec keeps it, and every thread
     the server starts inherits it. The chart's args (--config ...) follow as "$@". */}}
command:
  - /bin/sh
  - -c
  - '{ echo {{ mul (int .root.Values.timerSlackUs) 1000 }} > /proc/self/timerslack_ns; } 2>/dev/null; exec nats-server "$@"'
  - nats-server
{{- end }}
securityContext:
  allowPrivilegeEscalation: false
  capabilities: {drop: [ALL]}
  runAsNonRoot: true
  seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* Merged into the NATS sub-chart's pod templates: non-root, RuntimeDefault seccomp, pull secrets. */}}
{{- define "cache-indexer.natsPod" -}}
{{- $g := .Values.global | default dict -}}
spec:
  securityContext:
    runAsNonRoot: true
    runAsUser: 1000
    runAsGroup: 1000
    fsGroup: 1000
    seccompProfile: {type: RuntimeDefault}
  {{- with $g.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/* ---- NATS authentication and TLS -------------------------------------------------------------
     The bundled NATS gets one user per role, their passwords in a Secret (generated and kept across
     upgrades, or nats.auth.existingSecret); the processes get their role's user and password as
     environment from that Secret, never through the ConfigMap. These helpers also render inside the
     NATS sub-chart (its config.merge and container.env, through its $tplYaml), where .Values are the
     sub-chart's: they take the auth values and the release name explicitly. */}}
{{- define "cache-indexer.natsAuthSecret" -}}
{{- .auth.existingSecret | default (printf "%s-nats-auth" (.release | trunc 53 | trimSuffix "-")) -}}
{{- end -}}

{{/* Stream subjects and JetStream assets (the processes' defaults: nats.l1Stream, nats.l3Stream,
     nats.lease.bucket, snapshot.bucket and snapshot.metaBucket). */}}
{{- define "cache-indexer.natsAssets" -}}
streams: [KV_L1, KV_L3, KV_cache-indexer-leases, KV_cache-indexer-meta, OBJ_cache-indexer-snapshots]
{{- end -}}

{{/* NATS authorization of the bundled server (in the sub-chart's context). The bridge publishes to the
     stream subjects and its KV records; indexers read the streams, write snapshots, and only they purge
     (the snapshot writer compacts KV_L1 and prunes old snapshots); nobody deletes a stream; admin is
     for operators (nats-box). */}}
{{- define "cache-indexer.natsAuthorization" -}}
{{- if (.Values.auth | default dict).enabled -}}
{{- $streams := (include "cache-indexer.natsAssets" . | fromYaml).streams -}}
{{- $manage := list "$JS.API.INFO" "$JS.API.STREAM.INFO.*" "$JS.API.STREAM.NAMES" "$JS.API.STREAM.LIST" "$JS.API.STREAM.MSG.GET.*" "$JS.API.DIRECT.GET.>" "$JS.API.CONSUMER.>" "$JS.ACK.>" "$JS.FC.>" -}}
{{- range $s := $streams -}}
{{- $manage = concat $manage (list (printf "$JS.API.STREAM.CREATE.%s" $s) (printf "$JS.API.STREAM.UPDATE.%s" $s)) -}}
{{- end -}}
{{- $kv := list "$KV.cache-indexer-leases.>" "$KV.cache-indexer-meta.>" -}}
{{- $deny := list "$JS.API.STREAM.DELETE.>" "$JS.API.STREAM.MSG.DELETE.>" -}}
authorization:
  users:
    - user: cache-indexer-bridge
      password: "<< $CACHE_INDEXER_BRIDGE_PASSWORD >>"
      permissions:
        publish:
          allow: {{ concat (list "kvcache.l1.>" "kvcache.l3.>") $kv $manage | toJson }}
          deny: {{ append $deny "$JS.API.STREAM.PURGE.>" | toJson }}
        subscribe:
          allow: ["_INBOX.>"]
    - user: cache-indexer-indexer
      password: "<< $CACHE_INDEXER_INDEXER_PASSWORD >>"
      permissions:
        publish:
          allow: {{ concat $kv (list "$O.cache-indexer-snapshots.>" "$JS.API.STREAM.PURGE.KV_L1" "$JS.API.STREAM.PURGE.OBJ_cache-indexer-snapshots") $manage | toJson }}
          deny: {{ concat $deny (list "kvcache.>") | toJson }}
        subscribe:
          allow: ["_INBOX.>"]
    - user: admin
      password: "<< $CACHE_INDEXER_ADMIN_PASSWORD >>"
{{- end -}}
{{- end -}}

{{/* The NATS container's environment (sub-chart context): GOMAXPROCS (nats.goMaxProcs), and the passwords its
     configuration reads. */}}
{{- define "cache-indexer.natsServerEnv" -}}
{{- with .Values.goMaxProcs }}
GOMAXPROCS: {{ . | quote }}
{{- end }}
{{- if (.Values.auth | default dict).enabled -}}
{{- $secret := include "cache-indexer.natsAuthSecret" (dict "auth" .Values.auth "release" .Release.Name) -}}
{{- range $role := list "bridge" "indexer" "admin" }}
CACHE_INDEXER_{{ upper $role }}_PASSWORD:
  valueFrom:
    secretKeyRef: {name: {{ $secret }}, key: {{ $role }}-password}
{{- end }}
{{- end -}}
{{- end -}}

{{/* The Secret holding the registration token (key "token"): registration.existingSecret, or the one
     the chart generates and keeps across upgrades. */}}
{{- define "cache-indexer.registrationSecret" -}}
{{- .Values.registration.existingSecret | default (printf "%s-registration" (include "cache-indexer.fullname" .) | trunc 63 | trimSuffix "-") -}}
{{- end -}}

{{/* nats-box as the admin user (the nats CLI reads NATS_USER / NATS_PASSWORD). */}}
{{- define "cache-indexer.natsBoxAuthEnv" -}}
{{- if (.Values.auth | default dict).enabled -}}
NATS_USER: admin
NATS_PASSWORD:
  valueFrom:
    secretKeyRef:
      name: {{ include "cache-indexer.natsAuthSecret" (dict "auth" .Values.auth "release" .Release.Name) }}
      key: admin-password
{{- end -}}
{{- end -}}

{{/* Our container's environment (.role: bridge or indexer): its NATS credentials (the bundled NATS's
     role user, or what externalNats names in a Secret; files, an nkey seed or .creds, are mounted by
     natsClientVolumes), and the indexers' registration token (registration.enabled). */}}
{{- define "cache-indexer.containerEnv" -}}
{{- /* the mounted configuration: what `kubectl exec ... cache-indexer events view` (any command without
     --config) reads, so it finds the NATS server the process uses */ -}}
{{- $env := list (dict "name" "CACHE_INDEXER_CONFIG" "value" "/etc/cache-indexer/config.yaml") -}}
{{- if .Values.nats.enabled -}}
{{- if .Values.nats.auth.enabled -}}
{{- $secret := include "cache-indexer.natsAuthSecret" (dict "auth" .Values.nats.auth "release" .Release.Name) -}}
{{- $env = append $env (dict "name" "CACHE_INDEXER_NATS__USER" "value" (printf "cache-indexer-%s" .role)) -}}
{{- $env = append $env (dict "name" "CACHE_INDEXER_NATS__PASSWORD" "valueFrom" (dict "secretKeyRef" (dict "name" $secret "key" (printf "%s-password" .role)))) -}}
{{- end -}}
{{- else -}}
{{- $x := .Values.externalNats -}}
{{- if $x.user -}}
{{- $env = append $env (dict "name" "CACHE_INDEXER_NATS__USER" "value" $x.user) -}}
{{- end -}}
{{- range $key, $var := dict "passwordKey" "CACHE_INDEXER_NATS__PASSWORD" "tokenKey" "CACHE_INDEXER_NATS__TOKEN" -}}
{{- if get $x $key -}}
{{- if not $x.secretName }}{{ fail (printf "externalNats.%s needs externalNats.secretName" $key) }}{{ end -}}
{{- $env = append $env (dict "name" $var "valueFrom" (dict "secretKeyRef" (dict "name" $x.secretName "key" (get $x $key)))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (eq .role "indexer") .Values.registration.enabled -}}
{{- $secret := include "cache-indexer.registrationSecret" . -}}
{{- $env = append $env (dict "name" "CACHE_INDEXER_HTTP__REGISTRATIONTOKEN" "valueFrom" (dict "secretKeyRef" (dict "name" $secret "key" "token"))) -}}
{{- end -}}
{{- with $env }}
env:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Files of NATS credentials and TLS, from Secrets: volumeMounts (.part "mounts") or volumes. */}}
{{- define "cache-indexer.natsClientVolumes" -}}
{{- $x := .Values.externalNats -}}
{{- $files := and (not .Values.nats.enabled) (or $x.nkeySeedKey $x.credsKey) -}}
{{- if and $files (not $x.secretName) }}{{ fail "externalNats.nkeySeedKey / credsKey need externalNats.secretName" }}{{ end -}}
{{- if eq .part "mounts" -}}
{{- if $files }}
- name: nats-credentials
  mountPath: /etc/nats-credentials
  readOnly: true
{{- end }}
{{- if .Values.natsTls.secretName }}
- name: nats-tls
  mountPath: /etc/nats-tls
  readOnly: true
{{- end }}
{{- else -}}
{{- if $files }}
- name: nats-credentials
  secret:
    secretName: {{ $x.secretName }}
    defaultMode: 0440
{{- end }}
{{- if .Values.natsTls.secretName }}
- name: nats-tls
  secret:
    secretName: {{ .Values.natsTls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end -}}
{{- end -}}

{{/* The nats section's file settings for the ConfigMap (paths only; secrets never go there). */}}
{{- define "cache-indexer.natsClientFiles" -}}
{{- $x := .Values.externalNats -}}
{{- if not .Values.nats.enabled }}
{{- with $x.nkeySeedKey }}
nkeySeedFile: /etc/nats-credentials/{{ . }}
{{- end }}
{{- with $x.credsKey }}
credsFile: /etc/nats-credentials/{{ . }}
{{- end }}
{{- end }}
{{- with .Values.natsTls }}
{{- if .secretName }}
tls:
  caFile: /etc/nats-tls/{{ .caKey | default "ca.crt" }}
  {{- if .clientCertificate }}
  certFile: /etc/nats-tls/tls.crt
  keyFile: /etc/nats-tls/tls.key
  {{- end }}
  {{- with .serverName }}
  serverName: {{ . | quote }}
  {{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Indexers (and bridges) spread over nodes: a node lost takes one replica, not all of them. */}}
{{- define "cache-indexer.spread" -}}
{{- $spread := .Values.topologySpread | default dict -}}
{{- if $spread.enabled }}
topologySpreadConstraints:
  - maxSkew: {{ $spread.maxSkew }}
    topologyKey: {{ $spread.topologyKey }}
    whenUnsatisfiable: {{ $spread.whenUnsatisfiable }}
    labelSelector:
      matchLabels:
        {{- include "cache-indexer.selectorLabels" . | nindent 8 }}
        app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{/* Seconds of a duration as the processes read it: a number of seconds or 500ms, 10s, 2m, 1h. */}}
{{- define "cache-indexer.seconds" -}}
{{- $s := toString . | trim -}}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $s -}}
{{- $unit := trimPrefix $num $s | trim -}}
{{- $mult := dict "" 1.0 "s" 1.0 "ms" 0.001 "m" 60.0 "h" 3600.0 -}}
{{- if or (not $num) (not (hasKey $mult $unit)) -}}
{{- fail (printf "not a duration: %q (a number of seconds or e.g. 500ms, 10s, 2m, 1h)" $s) -}}
{{- end -}}
{{- mulf (float64 $num) (get $mult $unit) -}}
{{- end -}}

{{/* terminationGracePeriodSeconds: the process stops itself within http.shutdownTimeout (draining the
     API, handing the bridge lease over, flushing publishes); 10 s more before Kubernetes kills it. */}}
{{- define "cache-indexer.gracePeriod" -}}
{{- add (include "cache-indexer.seconds" .Values.http.shutdownTimeout | float64 | ceil | int) 10 -}}
{{- end -}}
