{{/* The product's NATS settings a chart user gives under nats (schemas/chart_values.py,
     CHART_NATS_SETTINGS), with the deprecated jetstream.* folded over them: jetstream.l1.* is
     nats.l1Stream.*, jetstream.l3.* nats.l3Stream.*, jetstream.replicas nats.replicas, jetstream.leaseTtl
     nats.lease.ttl, jetstream.duplicateWindow and .storage both streams'. A jetstream key given wins over
     the chart's defaults under nats. */}}
{{- define "cache-indexer.natsSettings" -}}
{{- $out := dict -}}
{{- range $k := list "replicas" "lease" "l1Stream" "l3Stream" "publish" "connectTimeout" "disconnectGrace" -}}
{{- if hasKey $.Values.nats $k -}}{{- $_ := set $out $k (deepCopy (get $.Values.nats $k)) -}}{{- end -}}
{{- end -}}
{{- with .Values.jetstream -}}
{{- if hasKey . "replicas" -}}{{- $_ := set $out "replicas" .replicas -}}{{- end -}}
{{- if hasKey . "leaseTtl" -}}{{- $_ := set $out "lease" (merge (dict "ttl" .leaseTtl) ($out.lease | default dict)) -}}{{- end -}}
{{- range $tier := list "l1" "l3" -}}
{{- $stream := get $out (printf "%sStream" $tier) | default dict -}}
{{- range $k := list "duplicateWindow" "storage" -}}
{{- if hasKey $.Values.jetstream $k -}}{{- $_ := set $stream $k (get $.Values.jetstream $k) -}}{{- end -}}
{{- end -}}
{{- range $k, $v := (get $.Values.jetstream $tier | default dict) -}}
{{- $_ := set $stream $k $v -}}
{{- end -}}
{{- $_ := set $out (printf "%sStream" $tier) $stream -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* Deprecated names the values use, one line each (for NOTES.txt): they work, but have a current name. */}}
{{- define "cache-indexer.deprecations" -}}
{{- $notes := list -}}
{{- if .Values.service.targetPort -}}{{- $notes = append $notes "service.targetPort: use http.port" -}}{{- end -}}
{{- if hasKey .Values.blockKey "prefixCachingHashAlgo" -}}{{- $notes = append $notes "blockKey.prefixCachingHashAlgo: use blockKey.hashAlgo" -}}{{- end -}}
{{- if .Values.discovery.labels -}}{{- $notes = append $notes "discovery.labels.*: use discovery.vllm.labelSelector, pdRoleLabel, pdRoles and discovery.mooncakeMaster.labelSelector" -}}{{- end -}}
{{- if .Values.jetstream -}}{{- $notes = append $notes "jetstream.*: use nats.replicas, nats.lease.ttl, nats.l1Stream.*, nats.l3Stream.*" -}}{{- end -}}
{{- range $notes }}
  - {{ . }}
{{- end -}}
{{- end -}}
