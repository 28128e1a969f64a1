#!/usr/bin/env bash
# One device call (eighth session, issue 20): norm tests; the add+norm entries of the
# dispatch table re-measured now that the benchmark's training step no longer copies
# add+norm's dx to a second output (bench/runner.py `_distinct`); then the training
# step, automatic choice against flax, for the plain and the add+norm ops.
# Usage: bash benchmarks/gpu_addstep.sh [stages] (tests,tables,step)
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests,tables,step}
source benchmarks/gpu_stages.sh
has tests && norm_tests
if has tables; then
  OP_TIMEOUT=150 bash benchmarks/gpu_tables.sh bf16 add_layer_norm,add_rms_norm ${TABLE_COLS:-256,768,1024,2048,4096,8192,16384} \
    > "$OUT/tables.txt" 2>&1
  grep -E "rc [0-9]|^[a-z_]+ (fwd|bwd|step) " "$OUT/tables.txt" | tee -a "$LOG"
  stage_done tables
fi
if has step; then
  timeout ${STEP_TIMEOUT:-300} python3 -m jax_ops.bench --repeats 3 --dtype bf16 --impl cuda,auto,flax \
    --op ${STEP_OPS:-add_layer_norm,add_rms_norm,layer_norm,rms_norm} --mode step \
    --cols ${STEP_COLS:-128,768,1024,2048,4096,8192,16384} --json "$OUT/step.json" > "$OUT/step.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd|step) |auto/best|within" "$OUT/step.txt" | tee -a "$LOG"
  stage_done step
fi
