#!/usr/bin/env bash
# One device call (eighth session, issue 20): after the forward block tier's 4-pack rule
# and the one-launch partial sums: norm tests, the bf16 dispatch-table entries of the
# norms re-measured, and the fwd / step sweep, automatic choice against flax.
# Usage: bash benchmarks/gpu_fwdk4.sh [stages] (tests,tables,sweep)
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests,tables}
source benchmarks/gpu_stages.sh
has tests && norm_tests
if has tables; then
  { OP_TIMEOUT=150 bash benchmarks/gpu_tables.sh bf16 layer_norm,rms_norm 32,64,128,256,1024,4096,8192,16384,32768
    OP_TIMEOUT=100 bash benchmarks/gpu_tables.sh bf16 add_layer_norm,add_rms_norm 256,768,16384; } > "$OUT/tables.txt" 2>&1
  grep -E "rc [0-9]" "$OUT/tables.txt" | tee -a "$LOG"
  stage_done tables
fi
if has sweep; then
  timeout 400 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --impl cuda,auto,flax \
    --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode fwd,step \
    --cols ${SWEEP_COLS:-32,128,256,1024,4096,8192,16384,32768} --json "$OUT/sweep.json" > "$OUT/sweep.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd|step) |auto/best|within" "$OUT/sweep.txt" | tee -a "$LOG"
  stage_done sweep
fi
