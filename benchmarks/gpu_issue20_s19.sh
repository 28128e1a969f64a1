#!/usr/bin/env bash
# Device calls of the nineteenth session (issue 20): two experiments on the 65536-column
# cluster forward (neither kept), where its time goes, and the tables' narrow entries
# with the training forward timed alone. Stages:
# fwdab (norm_bounds.py params at 65536 columns, bf16, 4096 rows, under each FWD_CFGS
# value "STAGES:PACKS" of knobs JAX_OPS_NORM_FWD_CLUSTER_STAGES / _PACKS, 0 = the cached
# kernel; the list twice, reversed the second time); fwdf32 (float32 LayerNorm / RMSNorm
# fwd and fwd_bwd at F32_COLS, cuda, under each FWD_CFGS value); cfgcheck
# (sanitize_norm.py without the sanitizer: cuda against xla at CHECK_COLS, CHECK_ROWS
# rows, every FWD_CFGS value); halfab (the forward's 16-bit rows in packs of 4 against 8,
# knob JAX_OPS_NORM_FWD_CLUSTER_HALF_PACK: norm_bounds.py params at 65536 for HALF_VALUES,
# the add+norms' fwd / fwd_bwd at 4096 x 65536 for HALF_ADD_VALUES). The FWD_CFGS knobs
# were only in run 1's build (fwd_cluster_async_kernel), HALF_PACK only in run 3's.
# ncufwd (ncu of the smem-cached cluster forward at 4096 x 65536, LayerNorm / RMSNorm:
# stalls, DRAM / L2 / L1 throughput); ncul2 (benchmarks/norm_fwd_l2_ncu.py under ncu: L2
# and L1 traffic of XLA's x * s + b against our LayerNorm / RMSNorm forwards there);
# ncubwd (ncu of the 65536-column backward, bwd_cluster_smem_kernel, 4096 rows);
# sanitize (memcheck / synccheck / racecheck at SAN_COLS, SAN_ROWS rows, LayerNorm /
# RMSNorm); racenarrow (racecheck of the four ops at RACE_NARROW_COLS, SAN_ROWS rows);
# tests; tablesnarrow (the table's NARROW_OPS (LayerNorm / RMSNorm) NARROW_DT (bf16)
# entries at NARROW_COLS with TABLE_MODES (fwd,bwd,step,fwd_res), into TABLE (the
# H100's)); sweepnarrow (item 1: the same ops and dtype, fwd / bwd / fwd_bwd at
# NARROW_COLS, auto / cuda / flax); sweeplong (item 1 at 65536: LONG_OPS bf16, 4096 rows).
# Usage: bash benchmarks/gpu_issue20_s19.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-fwdab}
source benchmarks/gpu_stages.sh
CFGS=${FWD_CFGS:-0:4 2:4 3:4 2:2 3:2}
cfg_env() { echo "JAX_OPS_NORM_FWD_CLUSTER_STAGES=${1%:*} JAX_OPS_NORM_FWD_CLUSTER_PACKS=${1#*:}"; }
# norm_bounds.py params at 4096 x 65536 once per environment setting (each argument: a
# space-separated list of VAR=value), to $OUT/NAME.txt and the log: params_ab NAME SETTING...
params_ab() {
  local name=$1 e
  shift
  for e in "$@"; do
    echo "== $e"
    env $e PARAM_ROWS_MB=512 timeout 90 python3 benchmarks/norm_bounds.py params 65536 2>&1 | grep -E "cuda|copy"
  done > "$OUT/$name.txt" 2>&1
  grep -E "^== |cuda" "$OUT/$name.txt" | tee -a "$LOG"
  stage_done "$name"
}
if has fwdab; then
  settings=()
  for c in $CFGS $(echo $CFGS | tr ' ' '\n' | tac); do settings+=("$(cfg_env $c)"); done
  params_ab fwdab "${settings[@]}"
fi
if has halfab; then  # the cluster forward's 16-bit rows in packs of 4 / 8 (knob JAX_OPS_NORM_FWD_CLUSTER_HALF_PACK)
  settings=()
  for v in ${HALF_VALUES:-0 1 1 0}; do settings+=("JAX_OPS_NORM_FWD_CLUSTER_HALF_PACK=$v"); done
  params_ab halfab "${settings[@]}"
  KNOB_TIMEOUT=150 knob_sweep halfab_add JAX_OPS_NORM_FWD_CLUSTER_HALF_PACK "${HALF_ADD_VALUES:-1 2 2 1}" \
    --rows 4096 --op add_layer_norm,add_rms_norm --mode fwd,fwd_bwd --cols 65536
fi
if has fwdf32; then
  for c in $CFGS; do
    echo "== $c"
    env $(cfg_env $c) timeout 120 python3 -m jax_ops.bench --repeats 3 --dtype f32 --impl cuda \
      --op layer_norm,rms_norm --mode fwd,fwd_bwd --rows ${F32_ROWS:-4096} --cols ${F32_COLS:-32768,65536}
  done > "$OUT/fwdf32.txt" 2>&1
  grep -E "^== |^[a-z_]+ (fwd|fwd_bwd) " "$OUT/fwdf32.txt" | tee -a "$LOG"
  stage_done fwdf32
fi
if has cfgcheck; then
  for c in $CFGS; do
    echo "== $c"
    env $(cfg_env $c) ROWS=${CHECK_ROWS:-301} timeout 120 python3 benchmarks/sanitize_norm.py \
      "${CHECK_COLS:-32776,40000,65536,70000,131072}" 2>&1; echo "rc $?"
  done > "$OUT/cfgcheck.txt"
  grep -E "^== |rc [0-9]|MISMATCH|worst" "$OUT/cfgcheck.txt" | tee -a "$LOG"
  stage_done cfgcheck
fi
# ncu of one cuda kernel (the first launch matching KERNEL) of LayerNorm and RMSNorm at
# 4096 x 65536 bf16 (benchmarks/norm_bwd_ncu.py runs the forward, then the backward):
# stalls, DRAM / L2 / L1 throughput, to $OUT/NAME_OP.txt and the log: ncu_65536 NAME KERNEL
ncu_65536() {
  local name=$1 kernel=$2 op r M
  M=smsp__inst_executed.sum,launch__registers_per_thread,sm__warps_active.avg.per_cycle_active,gpu__time_duration.sum
  M=$M,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,launch__grid_size,launch__cluster_dim_x
  M=$M,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum
  M=$M,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_active
  M=$M,smsp__issue_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct
  M=$M,sm__cycles_active.avg,gpc__cycles_elapsed.max,launch__shared_mem_per_block_dynamic
  for r in long_scoreboard short_scoreboard wait barrier membar lg_throttle mio_throttle no_instruction math_pipe_throttle sleeping; do
    M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
  done
  for op in layer_norm rms_norm; do
    OP=$op ROWS=4096 timeout 120 ncu --kernel-name regex:$kernel --launch-count 1 --metrics $M \
      python3 benchmarks/norm_bwd_ncu.py 65536 > "$OUT/${name}_$op.txt" 2>&1
  done
  grep -E "inst_exec|registers|warps_active|duration|dram__|lts__|grid_size|cluster_dim|l1tex|issue_active|stalled|cycles|shared_mem" \
    "$OUT/${name}"_*.txt | sed 's/smsp__average_warps_issue_stalled_//' | tee -a "$LOG"
  stage_done "$name"
}
has ncufwd && ncu_65536 ncufwd fwd_block_kernel
has ncubwd && ncu_65536 ncubwd bwd_cluster_smem_kernel
if has ncul2; then  # where the parameters' bytes come from: XLA's x * s + b against our forwards (4096 x 65536)
  M=gpu__time_duration.sum,lts__t_bytes.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed
  M=$M,lts__t_sectors_srcunit_tex_op_read.sum,l1tex__t_sector_hit_rate.pct,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum
  M=$M,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_active
  M=$M,launch__grid_size,launch__block_size,sm__warps_active.avg.per_cycle_active,launch__shared_mem_per_block_dynamic
  for w in xla layer_norm rms_norm; do
    WHAT=$w timeout 120 ncu --launch-skip 1 --launch-count 1 --metrics $M python3 benchmarks/norm_fwd_l2_ncu.py > "$OUT/ncul2_$w.txt" 2>&1
  done
  grep -E "^  [a-zA-Z_]|gpu__|lts__|l1tex__|dram__|launch__|warps_active" "$OUT"/ncul2_*.txt | tee -a "$LOG"
  stage_done ncul2
fi
if has racenarrow; then  # racecheck of the four ops at narrow widths (the s18 group-tier backward)
  ROWS=${SAN_ROWS:-2001} OPS=ln,rms,add_ln,add_rms timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 \
    python3 benchmarks/sanitize_norm.py "${RACE_NARROW_COLS:-32,64,128}" > "$OUT/racenarrow.txt" 2>&1
  echo "racecheck rc $?" >> "$OUT/racenarrow.txt"
  grep -E "rc [0-9]|ERROR SUMMARY|MISMATCH|worst" "$OUT/racenarrow.txt" | tee -a "$LOG"
  stage_done racenarrow
fi
has sanitize && norm_sanitize "${SAN_ROWS:-301}" "${SAN_COLS:-40000,65536,70000}" "${RACE_COLS:-65536}"
has tests && norm_tests
if has tablesnarrow; then
  export TABLE=${TABLE:-jax_ops/tables/nvidia_h100_80gb_hbm3.json}
  TABLE_MODES=${TABLE_MODES:-fwd,bwd,step,fwd_res} table_stage ${NARROW_DT:-bf16} ${NARROW_OPS:-layer_norm,rms_norm} \
    "${NARROW_COLS:-32,64,128,256}"
fi
if has sweepnarrow; then
  SWEEP_TIMEOUT=200 sweep_stage sweep_narrow_${NARROW_DT:-bf16} --dtype ${NARROW_DT:-bf16} --rows 49152 \
    --op ${NARROW_OPS:-layer_norm,rms_norm} \
    --mode fwd,bwd,fwd_bwd --cols "${NARROW_COLS:-32,64,128,256}"
fi
if has sweeplong; then
  SWEEP_TIMEOUT=200 sweep_stage sweep_long_bf16 --dtype bf16 --rows 4096 --op ${LONG_OPS:-layer_norm,rms_norm} \
    --mode fwd,bwd,fwd_bwd --cols 65536
fi
finish_call "log|env|fwdab|fwdf32|cfgcheck|halfab|halfab_add|racenarrow|ncubwd_layer_norm|tests"
