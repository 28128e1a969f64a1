#!/usr/bin/env bash
# Device calls of the thirty-third session (issue 20). Stages:
# - tail_ab: the plain norms' forward at 264-384 16-bit columns with the row's last
#   columns spread over the lanes (fwd_tail_kernel) against JAX_OPS_NORM_FWD_TAIL=0 (two
#   packs a lane, fwd_regs_kernel), LayerNorm / RMSNorm fwd, bf16 twice and f16, 49152 rows;
# - bwd_ab: the backward so (bwd_tail_kernel) against JAX_OPS_NORM_BWD_TAIL=0 (two packs a
#   lane on 32 lanes, or three on 16), four ops bwd bf16 twice, LayerNorm / RMSNorm f16;
# - san: memcheck / synccheck of SAN_OPS at 301 rows x SAN_COLS;
# - tests: the norm tests;
# - item2: auto / cuda / flax, bf16, ITEM2_OPS, fwd and fwd_bwd at ITEM2_COLS;
# - ncu: ncu of the tail kernels (forward: LayerNorm bf16 264 / 320 / 384, RMSNorm 264;
#   backward: LayerNorm 264 / 384) to $OUT/ncu.txt.
# Usage: bash benchmarks/gpu_issue20_s33.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests}
source benchmarks/gpu_stages.sh
has tail_ab && cfg_sweep tail_ab "default FWD_TAIL=0 default FWD_TAIL=0" bf16 --rows 49152 --op layer_norm,rms_norm \
  --mode fwd --cols $TAIL_COLS
has tail_ab && cfg_sweep tail_ab_f16 "default FWD_TAIL=0" f16 --rows 49152 --op layer_norm,rms_norm \
  --mode fwd --cols $TAIL_COLS
if has bwd_ab; then
  cfg_sweep bwd_ab "default BWD_TAIL=0 default BWD_TAIL=0" bf16 --rows 49152 --op $OPS4 --mode bwd --cols $TAIL_COLS
  cfg_sweep bwd_ab_f16 "default BWD_TAIL=0" f16 --rows 49152 --op layer_norm,rms_norm --mode bwd --cols $TAIL_COLS
fi
if has san; then
  SAN_NAME=sanitize DTYPES=bfloat16,float16 SAN_OPS=${SAN_OPS:-ln,rms,add_ln,add_rms} norm_sanitize 301 ${SAN_COLS:-264,296,328,384} ""
fi
has tests && norm_tests
has item2 && SWEEP_TIMEOUT=300 sweep_stage sweep_item2_bf16 --dtype bf16 --rows 49152 \
  --op ${ITEM2_OPS:-$OPS4} --mode fwd,fwd_bwd --cols ${ITEM2_COLS:-264,320,384,448,512}
if has ncu; then
  M=smsp__inst_executed.sum,launch__registers_per_thread,sm__warps_active.avg.per_cycle_active,gpu__time_duration.sum
  M=$M,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active
  M=$M,l1tex__throughput.avg.pct_of_peak_sustained_active
  for r in long_scoreboard short_scoreboard wait not_selected lg_throttle no_instruction; do
    M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
  done
  {
    for c in 264 320 384; do ncu_case "LN fwd $c" fwd_tail_kernel 0 benchmarks/norm_fwd_ncu.py $c; done
    ncu_case "RMS fwd 264" fwd_tail_kernel 6 benchmarks/norm_fwd_ncu.py 264
    for c in 264 384; do ncu_case "LN bwd $c" bwd_tail_kernel 0 benchmarks/norm_bwd_ncu.py $c; done
  } > "$OUT/ncu.txt" 2>&1
  sed 's/smsp__average_warps_issue_stalled_//; s/  */ /g' "$OUT/ncu.txt" | tee -a "$LOG" | tail -3
  stage_done ncu
fi
finish_call "log|env|tests|ncu|tail_ab|tail_ab_f16|bwd_ab|bwd_ab_f16|sanitize"
