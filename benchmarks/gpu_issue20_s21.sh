#!/usr/bin/env bash
# Device calls of the twenty-first session (issue 20): the split column layout of the
# block-tier forwards (16-bit rows, float32 parameters; knob JAX_OPS_NORM_FWD_SPLIT), so
# that a warp's parameter loads read whole sectors once. Stages:
# abfwd (cuda fwd / fwd_bwd of LONG_OPS at LONG_COLS, 4096 rows, under each SPLIT value,
# the list reversed and repeated); abmid (the same at MID_COLS, 49152 rows); abk (the
# block forward's packs a thread, knob JAX_OPS_NORM_FWD_BLOCK_MAX_PACKS, at K_COLS); table
# (the four ops' bf16 table entries at TABLE_COLS); tests;
# sansplit (memcheck / synccheck at SPLIT_SAN_COLS, 301 rows, LayerNorm / RMSNorm /
# add_layer_norm); sweeplong (item 1 at 65536: auto / cuda / flax); sweepmid (the same for
# SWEEP_MID_OPS at SWEEP_MID_COLS, 49152 rows; SWEEP_IMPLS); workspace.
# Usage: bash benchmarks/gpu_issue20_s21.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-abfwd}
source benchmarks/gpu_stages.sh
LONG_OPS=${LONG_OPS:-layer_norm,rms_norm,add_layer_norm}
if has abfwd; then
  KNOB_TIMEOUT=150 knob_sweep abfwd JAX_OPS_NORM_FWD_SPLIT "${SPLIT_VALUES:-1 0 0 1}" \
    --rows 4096 --op "$LONG_OPS" --mode fwd,fwd_bwd --cols "${LONG_COLS:-32768,65536}"
fi
if has abmid; then
  KNOB_TIMEOUT=200 knob_sweep abmid JAX_OPS_NORM_FWD_SPLIT "${SPLIT_VALUES:-1 0 0 1}" \
    --rows 49152 --op layer_norm,rms_norm --mode fwd,fwd_bwd --cols "${MID_COLS:-4352,8192,16384,32768}"
fi
if has abk; then  # packs a thread of the block forward at 4352-7168 columns (160-224 threads at 4)
  knob_sweep abk JAX_OPS_NORM_FWD_BLOCK_MAX_PACKS "${K_VALUES:-4 2 1 1 2 4}" \
    --rows 49152 --op layer_norm,rms_norm --mode fwd --cols "${K_COLS:-4352,5120,6144,7168}"
fi
# The table's bf16 entries of the four ops at TABLE_COLS (gpu_tables.sh; later stages use them)
has table && TABLE_MODES=${TABLE_MODES:-fwd,bwd,step,fwd_res} table_stage bf16 \
  layer_norm,rms_norm,add_layer_norm,add_rms_norm "${TABLE_COLS:-4608}"
has tests && norm_tests
if has sansplit; then
  { for tool in memcheck synccheck; do
      ROWS=301 OPS=ln,rms,add_ln timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 \
        python3 benchmarks/sanitize_norm.py "${SPLIT_SAN_COLS:-4352,8448,16384,32768,65536}" 2>&1; echo "$tool rc $?"
    done; } > "$OUT/sansplit.txt"
  grep -E "rc [0-9]|ERROR SUMMARY|MISMATCH|worst" "$OUT/sansplit.txt" | tee -a "$LOG"
  stage_done sansplit
fi
if has sweeplong; then
  SWEEP_TIMEOUT=200 sweep_stage sweep_long_bf16 --dtype bf16 --rows 4096 --op layer_norm,rms_norm \
    --mode fwd,bwd,fwd_bwd --cols 65536
fi
if has sweepmid; then  # item 1 where the split layout or the block tier's shape changes the picture
  SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-200} sweep_stage sweep_mid_bf16 --dtype bf16 --rows 49152 \
    --op "${SWEEP_MID_OPS:-layer_norm,rms_norm}" --mode fwd,fwd_bwd --cols "${SWEEP_MID_COLS:-4352,4608,32768}"
fi
has workspace && workspace_stage workspace
finish_call "log|env|abfwd|abmid|abk|tests|sansplit|workspace"
