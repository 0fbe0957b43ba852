{{/*
What values.schema.json cannot say: relations between values and arithmetic on sizes. Every
failure is one line naming the values to change. Included once, by rayservice.yaml.
*/}}
{{- define "ucm-ray.checks" -}}
{{- $v := .Values -}}
{{- $tier := $v.tier -}}
{{- $shardCpus := ternary $tier.shard_cpus 0.5 (hasKey $tier "shard_cpus") -}}
{{- $w := $v.worker -}}
{{- $h := $v.head -}}

{{- /* The pool: the bounds ucm_ray.config enforces, in bytes. */ -}}
{{- $pool := include "ucm-ray.bytes" (dict "value" $tier.pool_bytes "key" "tier.pool_bytes") | int64 -}}
{{- if or (lt $pool 4096) (gt $pool 17592186044416) -}}
  {{- fail (printf "tier.pool_bytes: %v is %d bytes; expected between 4096 and 17592186044416 (16Ti)" $tier.pool_bytes $pool) -}}
{{- end -}}

{{- /* Each group's /dev/shm must fit its memory request (tmpfs pages count against the pod's memory). */ -}}
{{- range $group := list "head" "worker" -}}
  {{- $g := index $v $group -}}
  {{- $store := include "ucm-ray.bytes" (dict "value" $g.objectStoreMemory "key" (printf "%s.objectStoreMemory" $group)) | int64 -}}
  {{- if lt $store 78643200 -}}
    {{- fail (printf "%s.objectStoreMemory: %v is below Ray's minimum object store (75Mi)" $group $g.objectStoreMemory) -}}
  {{- end -}}
  {{- $shm := include "ucm-ray.shmBytes" (dict "root" $ "group" $group) | int64 -}}
  {{- $shards := include "ucm-ray.shardsOn" (dict "group" $g "tier" $tier) | int64 -}}
  {{- range $kind := list "requests" "limits" -}}
    {{- $mem := index ($g.resources | default dict) $kind | default dict -}}
    {{- if hasKey $mem "memory" -}}
      {{- $bytes := include "ucm-ray.bytes" (dict "value" $mem.memory "key" (printf "%s.resources.%s.memory" $group $kind)) | int64 -}}
      {{- if gt $shm $bytes -}}
        {{- fail (printf "%s: the shard pools do not fit the pod's memory: /dev/shm needs %s (%d shard(s) x tier.pool_bytes %s + objectStoreMemory %s + shmHeadroom %s) but %s.resources.%s.memory is %v; raise it or lower tier.pool_bytes / tier.shards_per_node" $group (include "ucm-ray.quantity" $shm) $shards (include "ucm-ray.quantity" $pool) (toString $g.objectStoreMemory) (toString $g.shmHeadroom) $group $kind $mem.memory) -}}
      {{- end -}}
    {{- end -}}
  {{- end -}}
  {{- if hasKey ($g.rayStartParams | default dict) "object-store-memory" -}}
    {{- fail (printf "%s.rayStartParams.object-store-memory: set %s.objectStoreMemory instead (the chart sizes /dev/shm from it)" $group $group) -}}
  {{- end -}}
  {{- range $m := $g.volumeMounts -}}
    {{- if eq (clean $m.mountPath) "/dev/shm" -}}
      {{- fail (printf "%s.volumeMounts: /dev/shm is mounted by the chart (sized from tier.pool_bytes, tier.shards_per_node, %s.objectStoreMemory and %s.shmHeadroom)" $group $group $group) -}}
    {{- end -}}
  {{- end -}}
  {{- range $vol := $g.volumes -}}
    {{- if eq $vol.name "shared-mem" -}}
      {{- fail (printf "%s.volumes: the name shared-mem is the chart's /dev/shm volume; pick another" $group) -}}
    {{- end -}}
  {{- end -}}
{{- end -}}

{{- /* Worker pods: KubeRay clamps replicas into [minReplicas, maxReplicas] silently; refuse instead. */ -}}
{{- if gt (int64 $w.minReplicas) (int64 $w.maxReplicas) -}}
  {{- fail (printf "worker.minReplicas (%d) is greater than worker.maxReplicas (%d)" (int64 $w.minReplicas) (int64 $w.maxReplicas)) -}}
{{- end -}}
{{- if or (lt (int64 $w.replicas) (int64 $w.minReplicas)) (gt (int64 $w.replicas) (int64 $w.maxReplicas)) -}}
  {{- fail (printf "worker.replicas (%d) is outside [worker.minReplicas, worker.maxReplicas] = [%d, %d]; KubeRay would clamp it" (int64 $w.replicas) (int64 $w.minReplicas) (int64 $w.maxReplicas)) -}}
{{- end -}}

{{- /* Engines: a replica's tensor-parallel ranks share one worker (STRICT_PACK). */ -}}
{{- $m := $v.model -}}
{{- range $key := list "tensor_parallel_size" "pipeline_parallel_size" -}}
  {{- if hasKey ($m.engineKwargs | default dict) $key -}}
    {{- fail (printf "model.engineKwargs.%s: set model.tensorParallelSize instead (the chart sizes placement bundles and checks GPUs from it)" $key) -}}
  {{- end -}}
{{- end -}}
{{- $tp := int64 $m.tensorParallelSize -}}
{{- $gpus := include "ucm-ray.workerGpus" . | int64 -}}
{{- if lt $gpus $tp -}}
  {{- fail (printf "model.tensorParallelSize %d needs %d GPUs on one worker, but a worker has %d (worker.resources.limits.nvidia.com/gpu)" $tp $tp $gpus) -}}
{{- end -}}
{{- $perPod := div $gpus $tp -}}
{{- $workerShards := include "ucm-ray.shardsOn" (dict "group" $w "tier" $tier) | int64 -}}
{{- $cpus := include "ucm-ray.millicpus" $w | int64 -}}
{{- if ge $cpus 0 -}}
  {{- $need := addf (mulf (mul $perPod $tp) ($m.cpusPerGpu | default 0) 1000.0) (mulf $workerShards $shardCpus 1000.0) -}}
  {{- if gt $need (float64 $cpus) -}}
    {{- fail (printf "worker: %g CPUs needed (%d engine replica(s) x %d GPUs x model.cpusPerGpu %v + %d shard(s) x tier.shard_cpus %v) but a worker has %g; raise worker.resources cpu or lower model.cpusPerGpu / tier.shard_cpus" (divf $need 1000.0) $perPod $tp ($m.cpusPerGpu | default 0) $workerShards $shardCpus (divf $cpus 1000.0)) -}}
  {{- end -}}
{{- end -}}

{{- /* Serve autoscaling: the minimums (prefill's and decode's with serve.mode pd) must fit the
most workers KubeRay will run. */ -}}
{{- $scalings := list (list "model.autoscaling" $m.autoscaling) -}}
{{- if eq .Values.serve.mode "pd" -}}
  {{- $scalings = append $scalings (list "model.prefillAutoscaling" $m.prefillAutoscaling) -}}
{{- end -}}
{{- $minimum := 0 -}}
{{- $named := list -}}
{{- range $scalings -}}
  {{- $key := index . 0 -}}
  {{- $a := index . 1 -}}
  {{- if gt (int64 $a.minReplicas) (int64 $a.maxReplicas) -}}
    {{- fail (printf "%s.minReplicas (%d) is greater than %s.maxReplicas (%d)" $key (int64 $a.minReplicas) $key (int64 $a.maxReplicas)) -}}
  {{- end -}}
  {{- $minimum = add $minimum (int64 $a.minReplicas) -}}
  {{- $named = append $named (printf "%s.minReplicas" $key) -}}
{{- end -}}
{{- $pods := ternary (int64 $w.maxReplicas) (int64 $w.replicas) (eq $h.enableInTreeAutoscaling true) -}}
{{- if gt (int64 $minimum) (mul $pods $perPod) -}}
  {{- fail (printf "%s %d does not fit: %d worker(s) x %d replica(s) of %d GPUs each hold %d; raise worker.replicas (worker.maxReplicas with the autoscaler) or lower the minimum" (join " + " $named) (int64 $minimum) $pods $perPod $tp (mul $pods $perPod)) -}}
{{- end -}}

{{- /* The tier: shards exist somewhere, and enough of them for the replication. */ -}}
{{- $headShards := include "ucm-ray.shardsOn" (dict "group" $h "tier" $tier) | int64 -}}
{{- $atStart := add (mul (int64 $w.replicas) $workerShards) $headShards -}}
{{- if eq $atStart 0 -}}
  {{- fail (printf "tier: no pod can host a shard (each needs tier.shard_cpus = %v Ray CPUs); give the workers CPUs or lower tier.shard_cpus" $shardCpus) -}}
{{- end -}}
{{- if gt (int64 ($tier.replication | default 1)) $atStart -}}
  {{- fail (printf "tier.replication %d exceeds the %d shard(s) the app starts with (%d worker(s) x %d per node + %d on the head)" (int64 $tier.replication) $atStart (int64 $w.replicas) $workerShards $headShards) -}}
{{- end -}}
{{- end -}}
