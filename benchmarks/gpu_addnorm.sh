#!/usr/bin/env bash
# One device call (eighth session, issue 20): fused residual add + norm against XLA's
# fused add + flax norm, every implementation, forward / backward / training-step
# order; Nsight Compute's view of the cuda add+norm kernels and of the LayerNorm
# forward's parameter loads. Usage: bash benchmarks/gpu_addnorm.sh [stages]
# (bench,ncu; default both). Env COLS: the sweep's columns.
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-bench,ncu}
source benchmarks/gpu_stages.sh
if has bench; then
  timeout ${BENCH_TIMEOUT:-330} python3 -m jax_ops.bench --repeats 3 --dtype bf16 --impl ${IMPLS:-cuda,pallas,auto,flax} \
    --op add_layer_norm,add_rms_norm --mode ${MODES:-fwd,bwd,step} --cols ${COLS:-768,1024,2048,4096,8192,16384} \
    --json "$OUT/add_norm.json" > "$OUT/add_norm.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd|step) " "$OUT/add_norm.txt" | tee -a "$LOG"
  stage_done bench
fi
if has ncu; then
  M=launch__registers_per_thread,launch__block_size,launch__grid_size,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active,l1tex__throughput.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,launch__shared_mem_per_block_dynamic
  COLS=${NCU_COLS:-4096,16384} timeout 200 ncu --metrics $M --kernel-name regex:'fwd|bwd' python3 benchmarks/addnorm_probe.py \
    > "$OUT/ncu.txt" 2>&1
  grep -E "^  [a-z_].*(fwd|bwd)|launch__registers|launch__grid_size|launch__block_size|occupancy_limit|warps_active|l1tex__thr|dram__thr|gpu__time|shared_mem" "$OUT/ncu.txt" \
    | sed -E 's/ +/ /g' | cut -c1-160 | tee -a "$LOG"
  stage_done ncu
fi
