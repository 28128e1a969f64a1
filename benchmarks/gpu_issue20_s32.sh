#!/usr/bin/env bash
# Device calls of the thirty-second session (issue 20). The ncu, vpt2, narrow and hoist
# stages ran on experiment builds (E, F: benchmarks/results/2026-11-29_H200_s32/README.md)
# whose knobs the tree no longer has; final_ab and the rest run on the tree. Stages:
# - ncu: ncu's instructions, issue activity, occupancy, L1 traffic and stall reasons of
#   the warp tier's forward (LayerNorm bf16 at 256 / 264 / 512 columns, RMSNorm at 264;
#   LayerNorm 264 with JAX_OPS_NORM_FWD_VPT2=1 and 3) and backward (LayerNorm at 384 /
#   512, RMSNorm at 384), 49152 rows, float32 parameters, one launch each, to
#   $OUT/ncu.txt;
# - vpt2: the forward at two packs a lane (264-512 16-bit columns) with the parameters
#   loaded once a tile (JAX_OPS_NORM_FWD_VPT2: 1 two rows a tile, 2 a persistent grid with
#   the next tile ahead, 3 both; 0 as before), fwd of LayerNorm / RMSNorm in bf16 at
#   264-512 columns twice, f16 once; JAX_OPS_NORM_FWD_REGS_THIRDS16=1: 33-48 packs (264-384
#   columns) at three a lane on 16 lanes;
# - vpt2_f16: the same in f16 for VPT2_CFGS;
# - narrow: the forward of 33-64 packs on 8 lanes a row at 5-8 packs a lane
#   (JAX_OPS_NORM_FWD_NARROW=8; 4: 33-36 packs on 4 lanes at 9) against the default and
#   FWD_VPT2=3, LayerNorm / RMSNorm bf16 at 264-512 twice; narrow_f16: f16 for NARROW_CFGS;
# - hoist: the backward at two or three 16-bit packs a lane with the scale in registers
#   across rows (JAX_OPS_NORM_BWD_HOIST=1; 2: also add+norm's three packs a lane on 32
#   lanes), bwd of the four ops in bf16 at 264-768 columns twice; hoist_f16: LayerNorm /
#   RMSNorm in f16 once;
# - fb: fwd_bwd of LayerNorm / RMSNorm in bf16 and f16 at 264 / 384 / 512, default and
#   FB_CFGS;
# - final_ab (build G, the rules kept): the forward's two-row tile at 33-56 packs against
#   JAX_OPS_NORM_FWD_VPT2_TILE=0 (LayerNorm / RMSNorm fwd, bf16 and f16, 264-512), the
#   backward's scale in registers against JAX_OPS_NORM_BWD_HOIST_SCALE=0 (four ops bwd,
#   bf16 and f16, 264-768);
# - tests: the norm tests; san: memcheck / synccheck of SAN_OPS at 301 rows x SAN_COLS,
#   racecheck at RACE_COLS;
# - tables: this GPU's table entries for each of TABLE_SPECS (DT:OPS:COLS);
# - item2: auto / cuda / flax, bf16 four ops, fwd and fwd_bwd at ITEM2_COLS;
# - bounds: each cuda kernel of a bf16 training step next to a copy of its own bytes
#   (benchmarks/norm_bounds.py kernels) at BOUND_COLS.
# Usage: bash benchmarks/gpu_issue20_s32.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests}
source benchmarks/gpu_stages.sh
if has ncu; then
  M=smsp__inst_executed.sum,launch__registers_per_thread,sm__warps_active.avg.per_cycle_active,gpu__time_duration.sum
  M=$M,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active
  M=$M,launch__grid_size,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum
  M=$M,l1tex__throughput.avg.pct_of_peak_sustained_active,lts__t_bytes.sum
  for r in long_scoreboard short_scoreboard wait not_selected lg_throttle mio_throttle no_instruction \
      math_pipe_throttle dispatch_stall drain branch_resolving; do
    M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
  done
  {
    for c in 256 264 512; do ncu_case "LN fwd $c" fwd_regs_kernel 0 benchmarks/norm_fwd_ncu.py $c; done
    ncu_case "RMS fwd 264" fwd_regs_kernel 6 benchmarks/norm_fwd_ncu.py 264
    for m in 1 3; do JAX_OPS_NORM_FWD_VPT2=$m ncu_case "LN fwd 264 VPT2=$m" fwd_regs_kernel 0 benchmarks/norm_fwd_ncu.py 264; done
    for c in 384 512; do ncu_case "LN bwd $c" bwd_regs_kernel 0 benchmarks/norm_bwd_ncu.py $c; done
    OP=rms_norm ncu_case "RMS bwd 384" bwd_regs_kernel 0 benchmarks/norm_bwd_ncu.py 384
    JAX_OPS_NORM_FWD_REGS_THIRDS16=1 ncu_case "LN fwd 264 THIRDS16" fwd_regs_kernel 0 benchmarks/norm_fwd_ncu.py 264
    JAX_OPS_NORM_BWD_HOIST=1 ncu_case "LN bwd 384 HOIST" bwd_regs_kernel 0 benchmarks/norm_bwd_ncu.py 384
  } > "$OUT/ncu.txt" 2>&1
  sed 's/smsp__average_warps_issue_stalled_//; s/  */ /g' "$OUT/ncu.txt" | tee -a "$LOG" | tail -3
  stage_done ncu
fi
if has vpt2; then
  V="default FWD_VPT2=1 FWD_VPT2=2 FWD_VPT2=3 FWD_REGS_THIRDS16=1"
  cfg_sweep vpt2 "$V $V" bf16 --rows 49152 --op layer_norm,rms_norm --mode fwd --cols 264,320,384,448,512
fi
if has narrow; then
  V="default FWD_NARROW=8 FWD_NARROW=4 FWD_VPT2=3"
  cfg_sweep narrow "$V $V" bf16 --rows 49152 --op layer_norm,rms_norm --mode fwd --cols 264,320,384,448,512
fi
has narrow_f16 && cfg_sweep narrow_f16 "${NARROW_CFGS:?}" f16 --rows 49152 --op layer_norm,rms_norm --mode fwd \
  --cols 264,320,384,448,512
has vpt2_f16 && cfg_sweep vpt2_f16 "${VPT2_CFGS:?}" f16 --rows 49152 --op layer_norm,rms_norm --mode fwd \
  --cols 264,384,512
if has hoist; then
  cfg_sweep hoist "default BWD_HOIST=2 default BWD_HOIST=2" bf16 --rows 49152 --op $OPS4 --mode bwd \
    --cols 264,384,448,512,640,768
fi
has hoist_f16 && cfg_sweep hoist_f16 "default BWD_HOIST=2" f16 --rows 49152 --op layer_norm,rms_norm --mode bwd \
  --cols 264,384,512
if has final_ab; then  # build G: the rules kept, each against its knob off
  cfg_sweep fwd_ab "default FWD_VPT2_TILE=0" "bf16 f16" --rows 49152 --op layer_norm,rms_norm --mode fwd \
    --cols 264,320,384,448,512
  cfg_sweep bwd_ab "default BWD_HOIST_SCALE=0" "bf16 f16" --rows 49152 --op $OPS4 --mode bwd \
    --cols 264,320,384,448,512,768
fi
has fb && cfg_sweep fb "default ${FB_CFGS:?}" "bf16 f16" --rows 49152 --op layer_norm,rms_norm --mode fwd_bwd \
  --cols 264,384,512
if has san; then
  SAN_NAME=sanitize DTYPES=bfloat16,float16 SAN_OPS=${SAN_OPS:-ln,rms,add_ln,add_rms} \
    norm_sanitize 301 ${SAN_COLS:-264,320,400,448,504,768} "${RACE_COLS:-}"
fi
has tests && norm_tests
has tables && table_specs "${TABLE_SPECS:?}"
has item2 && SWEEP_TIMEOUT=300 sweep_stage sweep_item2_bf16 --dtype bf16 --rows 49152 \
  --op ${ITEM2_OPS:-$OPS4} --mode fwd,fwd_bwd --cols ${ITEM2_COLS:-264,320,384,448,512}
if has bounds; then
  timeout ${BOUND_TIMEOUT:-300} python3 benchmarks/norm_bounds.py kernels $OPS4 ${BOUND_COLS:-128,256,384,512} \
    > "$OUT/bounds.txt" 2>&1
  grep -E "^[a-z_]+ [0-9]+ \|" "$OUT/bounds.txt" | tee -a "$LOG"
  stage_done bounds
fi
finish_call "log|env|tests|bounds|ncu|vpt2|vpt2_f16|narrow|narrow_f16|hoist|hoist_f16|fb|fwd_ab|bwd_ab|sanitize|tables_[a-z0-9]+_[0-9]+|env_tables"
