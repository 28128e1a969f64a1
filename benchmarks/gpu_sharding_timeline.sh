#!/usr/bin/env bash
# One device call on a 2-GPU machine (issue 23): where a sharded step's time goes.
# benchmarks/sharding_timeline.py (per-device timelines of the graph program, one GPU and
# sharded, and the compiled HLO) for CASES with XLA's defaults, then graph times of
# FLAG_CASES under each XLA_FLAGS variant of FLAG_SETS (';'-separated).
# Usage: bash benchmarks/gpu_sharding_timeline.sh   (extension: .carry/_ffi.so.gz)
set -uo pipefail
source benchmarks/gpu_extension.sh
nvidia-smi topo -m >> "$OUT/env.txt" 2>&1
CASES=${CASES:-layer_norm,rms_norm,softmax_causal,add_layer_norm}
FLAG_CASES=${FLAG_CASES:-layer_norm,softmax_causal}
FLAG_SETS=${FLAG_SETS:---xla_gpu_enable_latency_hiding_scheduler=true;--xla_gpu_enable_command_buffer=}
mkdir -p "$OUT/hlo"
t0=$SECONDS
timeout 330 python3 benchmarks/sharding_timeline.py --only "$CASES" --hlo "$OUT/hlo/sharded" \
  --out "$OUT/timeline_default.json" 2>&1 | grep -v "Warning\|deprecat" | tee "$OUT/timeline.txt"
echo "default: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
i=0
IFS=';' read -ra SETS <<< "$FLAG_SETS"
for flags in "${SETS[@]}"; do
  i=$((i + 1))
  echo "## XLA_FLAGS=$flags" | tee -a "$OUT/timeline.txt"
  XLA_FLAGS="$flags" timeout 150 python3 benchmarks/sharding_timeline.py --only "$FLAG_CASES" \
    --out "$OUT/timeline_flags$i.json" 2>&1 | grep -v "Warning\|deprecat" | tee -a "$OUT/timeline.txt"
  echo "flags $i: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
done
tar czf "$OUT/hlo.tgz" -C "$OUT" hlo && rm -rf "$OUT/hlo"
