{{/*
serveConfigV2: the Serve config `serve run` would take, with one application. serve.mode openai:
import path ucm_ray.serve:build_app, args Ray Serve LLM's (one llm_configs entry built from model.*);
serve.mode pd: ucm_ray.serve:build_pd_app, a prefill_config and a decode_config built from the same
model.* (the two must store under one namespace), scaled by model.prefillAutoscaling and
model.autoscaling. Either way plus the tier: section (tier.*, with pool_bytes in whole bytes so the
chart's /dev/shm arithmetic and the builder read the same number).
*/}}
{{- define "ucm-ray.serveConfig" -}}
{{- $v := .Values -}}
{{- $m := $v.model -}}
{{- $tier := deepCopy $v.tier -}}
{{- $_ := set $tier "pool_bytes" (include "ucm-ray.bytes" (dict "value" $v.tier.pool_bytes "key" "tier.pool_bytes") | int64) -}}
{{- with $v.diskTier -}}{{- if .enabled -}}
{{- $_ := set $tier "disk_dir" .mountPath -}}
{{- $_ := set $tier "disk_bytes" (include "ucm-ray.bytes" (dict "value" .bytes "key" "diskTier.bytes") | int64) -}}
{{- $_ := set $tier "disk_write_policy" .writePolicy -}}
{{- $_ := set $tier "disk_wait_s" .waitS -}}
{{- $_ := set $tier "disk_recompute_bytes_s" .recomputeBytesS -}}
{{- end -}}{{- end -}}
{{- $engine := deepCopy ($m.engineKwargs | default dict) -}}
{{- $_ := set $engine "tensor_parallel_size" (int64 $m.tensorParallelSize) -}}
{{- $bundle := dict "GPU" 1 -}}
{{- if $m.cpusPerGpu -}}{{- $_ := set $bundle "CPU" $m.cpusPerGpu -}}{{- end -}}
{{- $bundles := list -}}
{{- range until (int $m.tensorParallelSize) -}}{{- $bundles = append $bundles $bundle -}}{{- end -}}
proxy_location: {{ $v.serve.proxyLocation }}
http_options:
  host: 0.0.0.0
  port: {{ int64 $v.serve.port }}
applications:
  - name: {{ $v.serve.appName | toJson }}
    route_prefix: {{ $v.serve.routePrefix | toJson }}
    import_path: {{ ternary "ucm_ray.serve:build_pd_app" "ucm_ray.serve:build_app" (eq $v.serve.mode "pd") }}
    {{- with $v.serve.runtimeEnv }}
    runtime_env:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    args:
      tier:
        {{- toYaml $tier | nindent 8 }}
{{- $engineArgs := dict "m" $m "engine" $engine "bundles" $bundles -}}
      {{- if eq $v.serve.mode "pd" }}
      prefill_config:
        {{- include "ucm-ray.llmConfig" (merge (dict "a" $m.prefillAutoscaling) $engineArgs) | nindent 8 }}
      decode_config:
        {{- include "ucm-ray.llmConfig" (merge (dict "a" $m.autoscaling) $engineArgs) | nindent 8 }}
      {{- else }}
      llm_configs:
        - {{ include "ucm-ray.llmConfig" (merge (dict "a" $m.autoscaling) $engineArgs) | indent 10 | trim }}
      {{- end }}
{{- end -}}

{{/* One Ray Serve LLM engine config from model.*, scaled by "a" (an autoscaling block of values). */}}
{{- define "ucm-ray.llmConfig" -}}
{{- $m := .m -}}
{{- $a := .a -}}
model_loading_config:
  model_id: {{ $m.id | toJson }}
  model_source: {{ $m.source | toJson }}
{{- with $m.acceleratorType }}
accelerator_type: {{ . | toJson }}
{{- end }}
engine_kwargs:
  {{- toYaml .engine | nindent 2 }}
placement_group_config:
  bundles: {{ toJson .bundles }}
  strategy: STRICT_PACK  # a replica's ranks on one worker: its tier reads stay node-local
deployment_config:
  autoscaling_config:
    min_replicas: {{ int64 $a.minReplicas }}
    max_replicas: {{ int64 $a.maxReplicas }}
    {{- if hasKey $a "targetOngoingRequests" }}
    target_ongoing_requests: {{ toJson $a.targetOngoingRequests }}
    {{- end }}
{{- with $m.envVars }}
runtime_env:
  env_vars:
    {{- toYaml . | nindent 4 }}
{{- end }}
{{- end -}}
