#!/usr/bin/env bash
# One device call of the seventeenth session (issue 20), on an H200 only: the H200
# table's add+norm entries of dtype TABLE_DT (default f32: it had none, so a float32
# add+norm call there took bfloat16's entries), cuda / pallas / xla, fwd / bwd / step at
# TABLE_COLS, merged into jax_ops/tables/nvidia_h200.json; with them, the add+norm sweep
# of that dtype (SWEEP_OPS, auto / cuda / flax, SWEEP_MODES at SWEEP_COLS); then
# add+norm's one-jit fwd_bwd against flax with this build (bf16, ADD_COLS; none skips
# it). On any other GPU it runs nothing.
# Usage: bash benchmarks/gpu_h200_s17.sh
set -uo pipefail
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  nvidia-smi --query-gpu=name --format=csv,noheader
  echo "not an H200: nothing run"
  exit 0
fi
source benchmarks/gpu_extension.sh
STAGES=tables,sweep,addflax
source benchmarks/gpu_stages.sh
export TABLE=jax_ops/tables/nvidia_h200.json  # gpu_tables.sh merges into this table
DT=${TABLE_DT:-f32}
OP_TIMEOUT=${OP_TIMEOUT:-170} table_stage $DT add_layer_norm,add_rms_norm \
  ${TABLE_COLS:-32,64,128,256,512,1024,2048,4096,8192,16384}
for op in ${SWEEP_OPS:-add_layer_norm add_rms_norm}; do
  left=$((540 - (SECONDS - t0)))
  [ $left -gt 30 ] && SWEEP_TIMEOUT=$((left < 80 ? left : 80)) sweep_stage sweep_${op}_$DT --dtype $DT --rows 49152 \
    --op $op --mode ${SWEEP_MODES:-fwd,bwd,fwd_bwd} --cols ${SWEEP_COLS:-128,1024,4096}
done
left=$((570 - (SECONDS - t0)))
if [ $left -gt 30 ] && [ "${ADD_COLS:-}" != none ]; then
  timeout $left python3 -m jax_ops.bench --repeats 5 --dtype bf16 --rows 49152 --impl auto,cuda,flax \
    --op add_layer_norm,add_rms_norm --mode fwd_bwd --cols ${ADD_COLS:-1024,2048,8192} > "$OUT/addflax.txt" 2>&1
  grep -E "^[a-z_]+ fwd_bwd [a-z0-9]+ rows" "$OUT/addflax.txt" | tee -a "$LOG"
  stage_done addflax
fi
finish_call "log|env|auto_vs_best|addflax"
exit 0
