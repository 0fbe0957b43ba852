{{/*
serveConfigV2: the Serve config `serve run` would take, with one application whose import path is
ucm_ray.serve:build_app. Its args are Ray Serve LLM's (one llm_configs entry built from model.*)
plus the tier: section (tier.*, with pool_bytes in whole bytes so the chart's /dev/shm arithmetic
and the builder read the same number).
*/}}
{{- define "ucm-ray.serveConfig" -}}
{{- $v := .Values -}}
{{- $m := $v.model -}}
{{- $a := $m.autoscaling -}}
{{- $tier := deepCopy $v.tier -}}
{{- $_ := set $tier "pool_bytes" (include "ucm-ray.bytes" (dict "value" $v.tier.pool_bytes "key" "tier.pool_bytes") | int64) -}}
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
    import_path: ucm_ray.serve:build_app
    {{- with $v.serve.runtimeEnv }}
    runtime_env:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    args:
      tier:
        {{- toYaml $tier | nindent 8 }}
      llm_configs:
        - model_loading_config:
            model_id: {{ $m.id | toJson }}
            model_source: {{ $m.source | toJson }}
          {{- with $m.acceleratorType }}
          accelerator_type: {{ . | toJson }}
          {{- end }}
          engine_kwargs:
            {{- toYaml $engine | nindent 12 }}
          placement_group_config:
            bundles: {{ toJson $bundles }}
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
              {{- toYaml . | nindent 14 }}
          {{- end }}
{{- end -}}
