#!/usr/bin/env bash
# One device call (thirteenth session, issue 20): ncu's instruction count, registers,
# occupancy and stall reasons of the group tier's backward kernel (bwd_regs_kernel) for
# the LayerNorm backward at 32 and 128 bf16 columns with the next-tile prefetch off, and
# at 256 with it on (benchmarks/norm_bwd_ncu.py), to $OUT/ncu_COLS.txt.
# Usage: bash benchmarks/norm_ncu_stalls.sh
source benchmarks/gpu_extension.sh >/dev/null
M=smsp__inst_executed.sum,launch__registers_per_thread,sm__warps_active.avg.per_cycle_active,gpu__time_duration.sum
M=$M,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active
for r in long_scoreboard short_scoreboard wait math_pipe_throttle not_selected selected lg_throttle mio_throttle \
    barrier dispatch_stall no_instruction drain membar branch_resolving; do
  M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
done
ncu_at() {  # COLS PREFETCH
  JAX_OPS_NORM_BWD_REGS_PREFETCH=$2 timeout 120 ncu --kernel-name regex:bwd_regs_kernel --launch-count 1 --metrics $M \
    python3 benchmarks/norm_bwd_ncu.py $1 > "$OUT/ncu_$1.txt" 2>&1
}
ncu_at 128 0
ncu_at 32 0
ncu_at 256 1
grep -E "inst_exec|registers|warps_active|duration|dram__|issue_active|stalled" "$OUT"/ncu_*.txt |
  sed 's/smsp__average_warps_issue_stalled_//'
