{{- /*
Sizes of the longest trajectory (issue 54): what the render checks of Redis, the pull message
limit and the pods' memory limits count (store.yaml, validate.yaml). They mirror
services/common/routing_size.py, the codec's worst case (uniform routing), never the 242 B/token
floor or a measured mean; tests/chart/test_sizing.py keeps the two equal.
Legend: T tokens of the longest trajectory (rollout engine.max_model_len: prompt + every turn),
L MoE layers, K top-k, E experts of a registered model (store.models).
*/}}

{{- /* log2 C(E, K) bits, from above (within 2^-20): the codec's floor per row. */}}
{{- define "r3flow.floorBits" -}}
{{- $c := 1.0 }}
{{- range $i := until (int .k) }}{{ $c = divf (mulf $c (sub (int64 $.e) $i)) (add $i 1) }}{{ end }}
{{- $bits := 0 }}
{{- range until 256 }}{{ if ge $c 2.0 }}{{ $c = divf $c 2 }}{{ $bits = add $bits 1 }}{{ end }}{{ end }}
{{- $frac := 0.0 }}{{- $bit := 0.5 }}
{{- range until 20 }}
{{- $c = mulf $c $c }}
{{- if ge $c 2.0 }}{{ $c = divf $c 2 }}{{ $frac = addf $frac $bit }}{{ end }}
{{- $bit = divf $bit 2 }}
{{- end }}
{{- printf "%.9f" (addf $bits $frac (mulf $bit 2)) }}
{{- end }}

{{- /* Store defaults the checks need when store.config leaves them unset (StoreConfig's;
       tests/chart/test_sizing.py keeps them equal). */}}
{{- define "r3flow.storeDefaults" -}}
max_tokens_per_trajectory: 262144
max_pull_message_bytes: 536870912
max_stream_bytes: 268435456
malloc_keep_bytes: 268435456
{{- end }}

{{- /* The longest trajectory at the worst registered layout, as YAML (bytes, integers):
       tokens, group (sampling.n), trajectory (its worst-case wire bytes: routing_size.
       max_trajectory_bytes), groupBytes, decoded (a group's ids in the codec's dtype, as the
       trainer holds them), capture (one trajectory's ids as int32, 4 B each: what the rollout
       engine returns for a request). */}}
{{- define "r3flow.longestTrajectory" -}}
{{- $rcfg := .Values.rollout.config }}
{{- $tokens := int64 ((($rcfg.engine | default dict).max_model_len) | default 1024) }}
{{- $group := int64 (get ($rcfg.sampling | default dict) "n" | default 1) }}
{{- if not .Values.store.models }}
{{- fail "store.models: empty; the chart sizes Redis and pod memory for the longest trajectory at a registered routing layout: set store.models to the served model's {name, num_experts, top_k, moe_layers}" }}
{{- end }}
{{- $traj := int64 0 }}{{- $decoded := int64 0 }}{{- $capture := int64 0 }}
{{- range .Values.store.models }}
{{- $bits := float64 (include "r3flow.floorBits" (dict "e" .num_experts "k" .top_k)) }}
{{- $perToken := addf (divf (mulf .moe_layers $bits 1.0005) 8) 10 }}
{{- $chunk := add 128 (mul 3 .moe_layers) }}
{{- $traj = max $traj (add (int64 (ceil (mulf $tokens $perToken))) (mul 2 $chunk) 1024) }}
{{- $ids := mul $tokens .moe_layers .top_k }}
{{- $decoded = max $decoded (mul $group $ids (ternary 1 2 (le (int .num_experts) 256))) }}
{{- $capture = max $capture (mul $ids 4) }}
{{- end }}
tokens: {{ $tokens }}
group: {{ $group }}
trajectory: {{ $traj }}
groupBytes: {{ mul $group $traj }}
decoded: {{ $decoded }}
capture: {{ $capture }}
{{- end }}

{{- /* A Kubernetes memory quantity in bytes (plain, K/M/G/T, Ki/Mi/Gi/Ti). */}}
{{- define "r3flow.quantityBytes" -}}
{{- $q := toString . }}
{{- $units := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "K" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 }}
{{- $unit := regexFind "[KMGT]i?$" $q }}
{{- $num := trimSuffix $unit $q }}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]+)?$" $num) }}
{{- fail (printf "memory quantity %q is not understood" $q) }}
{{- end }}
{{- int64 (mulf (float64 $num) (get $units $unit | default 1)) }}
{{- end }}

{{- /* Refuse a memory limit (`.limit`, a quantity; unset: not checked) below `.need` bytes,
       naming `.value` and what the need is made of (`.why`). */}}
{{- define "r3flow.checkPodMemory" -}}
{{- if .limit }}
{{- $have := int64 (include "r3flow.quantityBytes" .limit) }}
{{- if lt $have (int64 .need) }}
{{- fail (printf "%s (%v = %d bytes) is below the %d bytes one process needs for the longest trajectory (%s); raise %s" .value .limit $have (int64 .need) .why .value) }}
{{- end }}
{{- end }}
{{- end }}
