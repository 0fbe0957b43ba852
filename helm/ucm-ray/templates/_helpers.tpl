{{/* Names and labels. */}}

{{- define "ucm-ray.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 47 | trimSuffix "-" -}}
{{- end -}}

{{/*
The RayService's name. At most 47 characters: KubeRay refuses a longer RayService name (its
services are named NAME-serve-svc, NAME-head-svc and must stay DNS labels).
*/}}
{{- define "ucm-ray.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 47 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ucm-ray.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ucm-ray.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ucm-ray.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ucm-ray.labels" -}}
helm.sh/chart: {{ include "ucm-ray.chart" . }}
{{ include "ucm-ray.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: ucm-ray
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/*
Pod labels: only what stays the same across chart upgrades. KubeRay replaces the whole Ray
cluster when a pod template changes (a chart version label would do that on every upgrade).
*/}}
{{- define "ucm-ray.podLabels" -}}
{{ include "ucm-ray.selectorLabels" . }}
app.kubernetes.io/part-of: ucm-ray
{{- end -}}

{{- define "ucm-ray.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
Sizes. "ucm-ray.bytes" (dict "value" V "key" "where.it.is") prints V as whole bytes: V is an
integer, or a string such as 64Gi, 512Mi, 1.5Gi, 100G, 64GiB (k/K M G T P E = 1000^n, Ki Mi Gi
Ti Pi Ei = 1024^n, an optional trailing B). Decimals are exact (integer arithmetic, no floats):
a fraction of a byte, more than 18 digits or more than 2^62 bytes fails naming the key. Callers
turn the result into a number with `int64`.
*/}}
{{- define "ucm-ray.bytes" -}}
{{- $v := .value -}}
{{- $exp10 := dict "" 0 "k" 3 "K" 3 "M" 6 "G" 9 "T" 12 "P" 15 "E" 18 -}}
{{- $exp2 := dict "Ki" 10 "Mi" 20 "Gi" 30 "Ti" 40 "Pi" 50 "Ei" 60 -}}
{{- if or (kindIs "float64" $v) (kindIs "int64" $v) (kindIs "int" $v) -}}
  {{- if or (lt (float64 $v) 0.0) (ne (float64 $v) (floor $v)) (gt (float64 $v) 4.6e18) -}}
    {{- fail (printf "%s: %v is not a byte count; expected whole bytes such as 68719476736 or '64Gi'" .key $v) -}}
  {{- end -}}
  {{- int64 $v -}}
{{- else if and (kindIs "string" $v) (regexMatch "^[0-9]+(\\.[0-9]+)?([kKMGTPE]|[KMGTPE]i)?B?$" $v) -}}
  {{- $num := regexReplaceAll "^([0-9.]+).*$" $v "${1}" -}}
  {{- $unit := regexReplaceAll "^[0-9.]+([kKMGTPE]|[KMGTPE]i|)B?$" $v "${1}" -}}
  {{- $frac := "" -}}
  {{- if contains "." $num -}}{{- $frac = regexReplaceAll "^[0-9]+\\." $num "" -}}{{- end -}}
  {{- $digits := regexReplaceAll "^0+([0-9])" (replace "." "" $num) "${1}" -}}
  {{- $mults := dict "" 1 "k" 1000 "K" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "P" 1000000000000000 "E" 1000000000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 "Ei" 1152921504606846976 -}}
  {{- $approx := mulf (float64 $num) (get $mults $unit) -}}
  {{- if or (gt (len $digits) 18) (gt $approx 4.6e18) -}}
    {{- fail (printf "%s: %q is beyond 2^62 bytes; a typo?" .key $v) -}}
  {{- end -}}
  {{- /* $digits (a leading 0 would read as octal: dropped) x unit / 10^len($frac), exactly */ -}}
  {{- $a := int64 $digits -}}
  {{- $n := len $frac -}}
  {{- $whole := true -}}
  {{- $bytes := 0 -}}
  {{- if hasKey $exp2 $unit -}}
    {{- $e := int (get $exp2 $unit) -}}
    {{- $p := min $e $n -}}
    {{- $den := mul (include "ucm-ray.ipow" (list 5 $n) | int64) (include "ucm-ray.ipow" (list 2 (sub $n $p)) | int64) -}}
    {{- $whole = eq (mod $a $den) 0 -}}
    {{- $bytes = mul (div $a $den) (include "ucm-ray.ipow" (list 2 (sub $e $p)) | int64) -}}
  {{- else -}}
    {{- $e := int (get $exp10 $unit) -}}
    {{- if ge $e $n -}}
      {{- $bytes = mul $a (include "ucm-ray.ipow" (list 10 (sub $e $n)) | int64) -}}
    {{- else -}}
      {{- $den := include "ucm-ray.ipow" (list 10 (sub $n $e)) | int64 -}}
      {{- $whole = eq (mod $a $den) 0 -}}
      {{- $bytes = div $a $den -}}
    {{- end -}}
  {{- end -}}
  {{- if not $whole -}}
    {{- fail (printf "%s: %q is not a whole number of bytes" .key $v) -}}
  {{- end -}}
  {{- $bytes -}}
{{- else -}}
  {{- fail (printf "%s: %v is not a size; expected bytes (an integer) or a string such as '64Gi', '512Mi', '100G'" .key $v) -}}
{{- end -}}
{{- end -}}

{{/* (list BASE EXP): BASE^EXP as an integer (EXP >= 0). */}}
{{- define "ucm-ray.ipow" -}}
{{- $base := index . 0 -}}
{{- $r := 1 -}}
{{- range until (int (index . 1)) -}}{{- $r = mul $r $base -}}{{- end -}}
{{- $r -}}
{{- end -}}

{{/* Whole bytes as a short quantity: 76Gi, 640Mi, or bytes. */}}
{{- define "ucm-ray.quantity" -}}
{{- $b := int64 . -}}
{{- if and (gt $b 0) (eq (mod $b 1073741824) 0) -}}{{ div $b 1073741824 }}Gi
{{- else if and (gt $b 0) (eq (mod $b 1048576) 0) -}}{{ div $b 1048576 }}Mi
{{- else -}}{{ $b }}{{- end -}}
{{- end -}}

{{/*
CPUs of a Ray node group as KubeRay gives them to `ray start`: rayStartParams num-cpus, else the
container's cpu limit, else its request. Prints millicores, or -1 when none is set (Ray then
counts the node's CPUs).
*/}}
{{- define "ucm-ray.millicpus" -}}
{{- $g := . -}}
{{- $v := "" -}}
{{- if hasKey ($g.rayStartParams | default dict) "num-cpus" -}}{{- $v = index $g.rayStartParams "num-cpus" | toString -}}
{{- else if hasKey ($g.resources.limits | default dict) "cpu" -}}{{- $v = $g.resources.limits.cpu | toString -}}
{{- else if hasKey ($g.resources.requests | default dict) "cpu" -}}{{- $v = $g.resources.requests.cpu | toString -}}
{{- end -}}
{{- if eq $v "" -}}-1
{{- else if hasSuffix "m" $v -}}{{ trimSuffix "m" $v | float64 | int64 }}
{{- else -}}{{ round (mulf (float64 $v) 1000.0) 0 | int64 }}
{{- end -}}
{{- end -}}

{{/* GPUs of the worker group: rayStartParams num-gpus, else the nvidia.com/gpu limit. */}}
{{- define "ucm-ray.workerGpus" -}}
{{- $w := .Values.worker -}}
{{- if hasKey ($w.rayStartParams | default dict) "num-gpus" -}}{{ index $w.rayStartParams "num-gpus" | toString | float64 | int64 }}
{{- else -}}{{ index $w.resources.limits "nvidia.com/gpu" | toString | float64 | int64 }}
{{- end -}}
{{- end -}}

{{/*
Shards a group's pods host: tier.shards_per_node where the group's Ray CPUs are > 0 and at least
tier.shard_cpus (ucm_ray.store.shard.fleet.shard_nodes), else 0. Argument: the group's values.
*/}}
{{- define "ucm-ray.shardsOn" -}}
{{- $cpus := include "ucm-ray.millicpus" .group | int64 -}}
{{- $need := mulf (ternary .tier.shard_cpus 0.5 (hasKey .tier "shard_cpus")) 1000.0 -}}
{{- if or (lt $cpus 0) (and (gt $cpus 0) (ge (float64 $cpus) $need)) -}}{{ .tier.shards_per_node | default 1 | int64 }}
{{- else -}}0
{{- end -}}
{{- end -}}

{{/* /dev/shm bytes for a group: (dict "root" $ "group" "worker"|"head"). */}}
{{- define "ucm-ray.shmBytes" -}}
{{- $g := index .root.Values .group -}}
{{- $pool := include "ucm-ray.bytes" (dict "value" .root.Values.tier.pool_bytes "key" "tier.pool_bytes") | int64 -}}
{{- $shards := include "ucm-ray.shardsOn" (dict "group" $g "tier" .root.Values.tier) | int64 -}}
{{- $store := include "ucm-ray.bytes" (dict "value" $g.objectStoreMemory "key" (printf "%s.objectStoreMemory" .group)) | int64 -}}
{{- $room := include "ucm-ray.bytes" (dict "value" $g.shmHeadroom "key" (printf "%s.shmHeadroom" .group)) | int64 -}}
{{- add (mul $pool $shards) $store $room -}}
{{- end -}}

{{/* rayStartParams as KubeRay wants them (strings), plus the object store size. */}}
{{- define "ucm-ray.rayStartParams" -}}
{{- $params := deepCopy (.params | default dict) -}}
{{- $_ := set $params "object-store-memory" (toString .objectStore) -}}
{{- range $k, $v := $params }}
{{ $k }}: {{ if kindIs "string" $v }}{{ $v | quote }}{{ else }}{{ $v | toJson | quote }}{{ end }}
{{- end -}}
{{- end -}}

{{/* A one-line account of a group's /dev/shm size: (dict "root" $ "group" "head"|"worker"). */}}
{{- define "ucm-ray.shmNote" -}}
{{- $g := index .root.Values .group -}}
{{- $shards := include "ucm-ray.shardsOn" (dict "group" $g "tier" .root.Values.tier) | int64 -}}
{{- $pool := include "ucm-ray.bytes" (dict "value" .root.Values.tier.pool_bytes "key" "tier.pool_bytes") | int64 -}}
{{- printf "%d shard pool(s) x %s + object store %s + headroom %s" $shards (include "ucm-ray.quantity" $pool) (toString $g.objectStoreMemory) (toString $g.shmHeadroom) -}}
{{- end -}}

{{/* Pod-level scheduling and pull secrets: (dict "root" $ "group" .Values.head|worker). */}}
{{- define "ucm-ray.podScheduling" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The Ray container's env, resources and mounts (the chart's /dev/shm first). */}}
{{- define "ucm-ray.container" -}}
{{- with .group.containerEnv }}
env:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.envFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
resources:
  {{- toYaml .group.resources | nindent 2 }}
volumeMounts:
  - name: shared-mem
    mountPath: /dev/shm
  {{- with .disk }}
  - name: ucm-ray-disk
    mountPath: {{ .mountPath | toJson }}
  {{- end }}
  {{- with .group.volumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/*
The disk tier's settings for a group's pods: (dict "root" $ "group" "worker"|"head"), diskTier when it
is on, else nothing. Every pod mounts something at mountPath: the app's config is checked (disk_dir
must exist) wherever Serve builds it, not only where shards run.
*/}}
{{- define "ucm-ray.diskFor" -}}
{{- if .root.Values.diskTier.enabled -}}
{{- toYaml .root.Values.diskTier -}}
{{- end -}}
{{- end -}}

{{/*
The disk tier's volume for a group's pods (same argument): hostPath, a directory on the node that
outlives the pod (a restarted shard adopts its files), or with storageClassName a generic ephemeral
claim per pod of that class (a local PersistentVolume), sized diskTier.bytes x the pod's shards.
*/}}
{{- define "ucm-ray.diskVolume" -}}
{{- $d := .root.Values.diskTier -}}
{{- $shards := include "ucm-ray.shardsOn" (dict "group" (index .root.Values .group) "tier" .root.Values.tier) | int64 }}
{{- if include "ucm-ray.diskFor" . }}
- name: ucm-ray-disk
  {{- if eq $shards 0 }}
  emptyDir: {}  # no shard here: only so that disk_dir exists where Serve may build the app
  {{- else if $d.storageClassName }}
  {{- $bytes := include "ucm-ray.bytes" (dict "value" $d.bytes "key" "diskTier.bytes") | int64 }}
  ephemeral:
    volumeClaimTemplate:
      spec:
        accessModes: [ReadWriteOnce]
        storageClassName: {{ $d.storageClassName | toJson }}
        resources:
          requests:
            storage: {{ include "ucm-ray.quantity" (mul $bytes $shards) }}
  {{- else }}
  hostPath:
    path: {{ required "diskTier.hostPath or diskTier.storageClassName: the disk tier needs a volume" $d.hostPath | toJson }}
    type: DirectoryOrCreate
  {{- end }}
{{- end }}
{{- end -}}
