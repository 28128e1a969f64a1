#!/usr/bin/env bash
# One device call (eighth session, issue 20): where the narrow-row (32-256 columns)
# norm backward's time goes, kernel by kernel (`kernel_breakdown.py`), and the narrow
# sweep of the current build; norm tests; the forward block tier's packs a thread at
# 16384-32768 columns (knob). Usage: bash benchmarks/gpu_narrow.sh [stages]
# (tests,breakdown,threads,sweep)
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests,breakdown,threads,sweep}
source benchmarks/gpu_stages.sh
has tests && norm_tests
if has breakdown; then
  for spec in "layer_norm 32" "layer_norm 128" "rms_norm 32" "layer_norm 256" "add_layer_norm 128"; do
    MODES=${MODES:-fwd,bwd} timeout 60 python3 benchmarks/kernel_breakdown.py ${spec% *} bf16 49152 ${spec#* } cuda
  done > "$OUT/breakdown.txt" 2>&1
  cut -c1-140 "$OUT/breakdown.txt" | grep -v '^$' | tee -a "$LOG"
  stage_done breakdown
fi
# Run 5 swept the forward block tier's threads a row (a knob since replaced); the
# rule it chose is JAX_OPS_NORM_FWD_BLOCK_MAX_PACKS=4, against the old 8.
has threads && knob_sweep threads JAX_OPS_NORM_FWD_BLOCK_MAX_PACKS "4 8" \
  --op layer_norm,rms_norm,add_layer_norm --mode fwd --cols 16384,32768
if has sweep; then
  timeout 150 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --impl cuda,auto,flax --op layer_norm,rms_norm,add_layer_norm \
    --mode fwd,bwd,step --cols 32,64,128,256 --json "$OUT/narrow.json" > "$OUT/narrow.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd|step) " "$OUT/narrow.txt" | tee -a "$LOG"
  stage_done sweep
fi
