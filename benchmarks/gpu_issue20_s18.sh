#!/usr/bin/env bash
# Device calls of the eighteenth session (issue 20): the measured bounds of the remaining
# misses, and the item-1 points the seventeenth session did not reach. Stages:
# bounds (benchmarks/norm_bounds.py kernels: each cuda kernel of a training step next to
# a copy of its own bytes, BOUND_OPS at BOUND_COLS, bf16, 49152 rows); params
# (norm_bounds.py params: XLA's affine fusions with float32 / bf16 / no broadcast
# parameters against our long-row kernels, PARAM_COLS); sweep65536 (add_rms_norm bf16 bwd
# and fwd_bwd at 8192 x 65536, auto / cuda / flax); sweepf16 (the add+norms in float16,
# bwd and fwd_bwd at F16_COLS, auto / cuda / flax); tests; sanitize (SAN_ROWS,
# SAN_COLS, RACE_COLS, all four ops); workspace; narrowab (the group-tier backward at
# one 16-bit pack a lane and fewer than 32 lanes a row, knob JAX_OPS_NORM_BWD_NARROW_ROWS:
# 0 two rows a group (then main), 1 one row, 2 one row and the next tile loaded ahead; the
# four ops, bwd and fwd_bwd at NARROW_COLS; the knob was only in run 2's build: 2 is now
# the default); ncu128 (ncu of the LayerNorm and RMSNorm
# backward kernels at 128 columns: instructions, occupancy, DRAM bytes, stalls);
# tablesnarrow (the table's entries at 32-256 columns re-measured: bf16 for the four ops
# or TABLE_BF16_OPS, f16 for LayerNorm / RMSNorm or TABLE_F16_OPS (none: skipped), with
# gpu_tables.sh's TABLE_MODES, merged into TABLE, default the H100's); sweepnarrow (item 1
# at NARROW_COLS: NARROW_OPS (the four), NARROW_DTYPES (bf16 f16), NARROW_MODES (fwd /
# bwd / fwd_bwd), auto / cuda / flax);
# sannarrow (memcheck and synccheck of the four ops at SAN_COLS, SAN_ROWS rows);
# breakdown (kernel_breakdown.py: auto's / cuda's / pallas' kernels in one fwd_bwd).
# Usage: bash benchmarks/gpu_issue20_s18.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-bounds,params}
source benchmarks/gpu_stages.sh
if has bounds; then
  timeout ${BOUND_TIMEOUT:-330} python3 benchmarks/norm_bounds.py kernels \
    "${BOUND_OPS:-layer_norm,rms_norm,add_layer_norm,add_rms_norm}" "${BOUND_COLS:-32,64,128,256}" \
    > "$OUT/bounds.txt" 2>&1
  grep -E "^[a-z_]+ [0-9]+ \|" "$OUT/bounds.txt" | tee -a "$LOG"
  stage_done bounds
fi
if has params; then
  timeout ${PARAM_TIMEOUT:-200} python3 benchmarks/norm_bounds.py params "${PARAM_COLS:-16384,65536}" \
    > "$OUT/params.txt" 2>&1
  grep -E "^cols|% of its copy" "$OUT/params.txt" | tee -a "$LOG"
  stage_done params
fi
if has sweep65536; then
  SWEEP_TIMEOUT=${SWEEP65536_TIMEOUT:-200} sweep_stage sweep_add_rms_norm_bf16_65536 --dtype bf16 --rows 8192 \
    --op add_rms_norm --mode bwd,fwd_bwd --cols 65536
fi
if has sweepf16; then
  SWEEP_TIMEOUT=${SWEEPF16_TIMEOUT:-300} sweep_stage sweep_addnorm_f16 --dtype f16 --rows 49152 \
    --op add_layer_norm,add_rms_norm --mode bwd,fwd_bwd --cols "${F16_COLS:-128,512,1024,2048,8192}"
fi
if has narrowab; then
  KNOB_TIMEOUT=${KNOB_TIMEOUT:-120} knob_sweep narrowab JAX_OPS_NORM_BWD_NARROW_ROWS "${NARROW_VALUES:-0 1 2 0 1 2}" \
    --rows 49152 --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode bwd,fwd_bwd --cols "${NARROW_COLS:-32,64,128}"
fi
if has ncu128; then
  M=smsp__inst_executed.sum,launch__registers_per_thread,sm__warps_active.avg.per_cycle_active,gpu__time_duration.sum
  M=$M,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,launch__grid_size,launch__occupancy_limit_registers
  M=$M,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active
  for r in long_scoreboard short_scoreboard wait barrier lg_throttle mio_throttle no_instruction; do
    M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
  done
  for op in layer_norm rms_norm; do
    OP=$op timeout 120 ncu --kernel-name regex:bwd_regs_kernel --launch-count 1 --metrics $M \
      python3 benchmarks/norm_bwd_ncu.py 128 > "$OUT/ncu128_$op.txt" 2>&1
  done
  grep -E "inst_exec|registers|warps_active|duration|dram__|lts__|grid_size|occupancy|issue_active|stalled" \
    "$OUT"/ncu128_*.txt | sed 's/smsp__average_warps_issue_stalled_//' | tee -a "$LOG"
  stage_done ncu128
fi
if has tablesnarrow; then
  export TABLE=${TABLE:-jax_ops/tables/nvidia_h100_80gb_hbm3.json}
  table_stage bf16 ${TABLE_BF16_OPS:-layer_norm,rms_norm,add_layer_norm,add_rms_norm} "${NARROW_COLS:-32,64,128,256}"
  mv "$OUT/tables.txt" "$OUT/tables_bf16.txt"
  [ "${TABLE_F16_OPS:-layer_norm,rms_norm}" != none ] &&
    table_stage f16 ${TABLE_F16_OPS:-layer_norm,rms_norm} "${NARROW_COLS:-32,64,128,256}"
fi
if has sweepnarrow; then
  for dt in ${NARROW_DTYPES:-bf16 f16}; do
    SWEEP_TIMEOUT=${SWEEPNARROW_TIMEOUT:-200} sweep_stage sweep_narrow_$dt --dtype $dt --rows 49152 \
      --op ${NARROW_OPS:-layer_norm,rms_norm,add_layer_norm,add_rms_norm} --mode ${NARROW_MODES:-fwd,bwd,fwd_bwd} \
      --cols "${NARROW_COLS:-32,64,128,256}"
  done
fi
has tests && norm_tests
if has sanitize; then
  SAN_OPS=ln,rms,add_ln,add_rms norm_sanitize "${SAN_ROWS:-3001}" "${SAN_COLS:-33,760,1024,2050,4096,8192}" \
    "${RACE_COLS:-1024,4096}"
fi
if has breakdown; then  # auto's and cuda's kernels in one fwd_bwd (BD_OP at BD_COLS)
  MODES=fwd_bwd timeout 150 python3 benchmarks/kernel_breakdown.py ${BD_OP:-layer_norm} bf16 49152 ${BD_COLS:-128} \
    auto cuda pallas > "$OUT/breakdown.txt" 2>&1
  cat "$OUT/breakdown.txt" | tee -a "$LOG"
  stage_done breakdown
fi
has workspace && workspace_stage
if has sannarrow; then  # memcheck and synccheck only, the four ops at narrow widths
  for tool in memcheck synccheck; do
    ROWS=${SAN_ROWS:-3001} OPS=ln,rms,add_ln,add_rms timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 \
      python3 benchmarks/sanitize_norm.py "${SAN_COLS:-1,3,8,31,33,64,127,128,200}" 2>&1; echo "$tool rc $?"
  done > "$OUT/sannarrow.txt"
  grep -E "rc [0-9]|ERROR SUMMARY|MISMATCH|worst" "$OUT/sannarrow.txt" | tee -a "$LOG"
  stage_done sannarrow
fi
finish_call "log|env|bounds|params|tests"
