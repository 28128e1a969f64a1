#!/usr/bin/env bash
# One device call (tenth session, issue 20): long rows. compute-sanitizer on the
# 16-bit cluster backward (SAN_COLS), the step / fwd_bwd sweep of the four norms at
# SWEEP_COLS (auto, cuda, flax), the LayerNorm forward's parameter loads (ncu and the
# knob JAX_OPS_NORM_FWD_PARAM_LOADS in norm_params_probe.py: that knob existed only in
# the experiment builds of runs 1-3, results/2026-11-26_H100_longrows; a no-op since).
# Later stages: tests, memcheck (MEM_COLS) and ab (the forward of .carry/_ffi_old.so.gz,
# the committed build, against this one).
# Usage: bash benchmarks/gpu_longrows.sh [stages] (sanitize,sweep,params,ncu,sass,tests,memcheck,ab,
# knobtests,workspace)
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-sanitize,sweep,params,ncu,sass}
source benchmarks/gpu_stages.sh
if has sanitize; then
  { for tool in memcheck synccheck racecheck; do
      ROWS=300 timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_norm.py \
        ${SAN_COLS:-16384,32768} 2>&1; echo "$tool rc $?"
    done; } > "$OUT/sanitize.txt"
  grep -E "rc [0-9]|ERROR SUMMARY|worst" "$OUT/sanitize.txt" | tee -a "$LOG"
  stage_done sanitize
fi
if has sweep; then
  timeout ${SWEEP_TIMEOUT:-300} python3 -m jax_ops.bench --repeats 3 --dtype bf16 --impl ${SWEEP_IMPLS:-auto,cuda,flax} \
    --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode ${SWEEP_MODES:-fwd,bwd,step,fwd_bwd} \
    --cols ${SWEEP_COLS:-16384,32768} --json "$OUT/sweep.json" > "$OUT/sweep.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd|step) " "$OUT/sweep.txt" | tee -a "$LOG"
  stage_done sweep
fi
if has params; then
  for m in ${PARAM_MODES:-0 1 2}; do
    echo "== JAX_OPS_NORM_FWD_PARAM_LOADS=$m"
    JAX_OPS_NORM_FWD_PARAM_LOADS=$m timeout 120 python3 benchmarks/norm_params_probe.py
  done > "$OUT/params.txt" 2>&1
  grep -E "^== |^cols" "$OUT/params.txt" | tee -a "$LOG"
  stage_done params
fi
if has ncu; then
  timeout 240 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    --section WarpStateStats --section Occupancy --section LaunchStats --kernel-name regex:fwd_block_regs \
    --launch-skip-before-match 0 python3 benchmarks/norm_fwd_ncu.py ${NCU_COLS:-16384,32768} > "$OUT/ncu.txt" 2>&1
  echo "ncu rc $?" | tee -a "$LOG"
  grep -E "fwd_block_regs_kernel|Duration|L1/TEX Hit Rate|L2 Hit Rate|Mem Busy|Max Bandwidth|L1/TEX Cache Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Stall Long|Warp Cycles Per Issued|Shared Memory Configuration Size" \
    "$OUT/ncu.txt" | sed -E 's/ +/ /g' | cut -c1-150 | tee -a "$LOG"
  stage_done ncu
fi
if has sass; then
  so=$(ls jax_ops/_ffi*.so)
  cuobjdump -sass -fun '_ZN7jax_ops4norm21fwd_block_regs_kernelINS_6bf16_tEfLi8ELi4ENS0_5LoadXIS2_EELi0EEEvNT3_4ArgsE' "$so" \
    > "$OUT/sass0.txt" 2>&1
  cuobjdump -sass -fun '_ZN7jax_ops4norm21fwd_block_regs_kernelINS_6bf16_tEfLi8ELi4ENS0_5LoadXIS2_EELi1EEEvNT3_4ArgsE' "$so" \
    > "$OUT/sass1.txt" 2>&1
  for f in sass0 sass1; do echo "== $f"; grep -nE "LDG|STG|BAR|SHFL" "$OUT/$f.txt" | sed -E 's/ +/ /g' | cut -c1-110; done \
    > "$OUT/sass_order.txt"
  (cd "$OUT" && tar czf sass.tgz sass0.txt sass1.txt && rm -f sass0.txt sass1.txt)
  stage_done sass
fi
has tests && norm_tests
if has memcheck; then
  ROWS=300 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_norm.py \
    ${MEM_COLS:-2050,4104,5000,16384,32768} > "$OUT/memcheck.txt" 2>&1; echo "memcheck rc $?" | tee -a "$LOG"
  grep -E "ERROR SUMMARY|worst" "$OUT/memcheck.txt" | tee -a "$LOG"
  stage_done memcheck
fi
# The forward of the committed build (.carry/_ffi_old.so.gz) against this one, cuda only
# (and its backward at AB_BWD_COLS, bf16).
ab_fwd() {
  for dt in ${AB_DTYPES:-bf16 f16 f32}; do
    cols=${AB_COLS:-8192,16384,32768}; [ $dt = f32 ] && cols=${AB_COLS_F32:-4096,8192,16384}
    echo "== $1 $dt"
    timeout 100 python3 -m jax_ops.bench --repeats 5 --dtype $dt --impl cuda --op layer_norm,rms_norm,add_layer_norm \
      --mode fwd --cols $cols
  done
  echo "== $1 bf16 bwd"
  [ -n "${AB_BWD_COLS-x}" ] && timeout 100 python3 -m jax_ops.bench --repeats 5 --dtype bf16 --impl cuda --op layer_norm,rms_norm,add_layer_norm \
    --mode bwd --cols ${AB_BWD_COLS:-16384,32768}
}
if has ab && [ -f .carry/_ffi_old.so.gz ]; then
  ab_builds ab ab_fwd
  grep -E "^== |^[a-z_]+ fwd " "$OUT/ab.txt" | tee -a "$LOG"
  stage_done ab
fi
if has knobtests; then
  JAX_OPS_NORM_FWD_PARAM_LOADS=${TEST_MODE:-6} timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider \
    tests/test_layer_norm.py tests/test_add_norm.py -k "${TEST_K:-16384 or 24577 or 32768}" > "$OUT/knobtests.txt" 2>&1
  tail -2 "$OUT/knobtests.txt" | tee -a "$LOG"
  JAX_OPS_NORM_FWD_PARAM_LOADS=${TEST_MODE:-6} ROWS=300 timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 benchmarks/sanitize_norm.py 16384,32768 > "$OUT/knobsan.txt" 2>&1; echo "memcheck rc $?" | tee -a "$LOG"
  stage_done knobtests
fi
# Forward experiment knobs (builds of the tenth session's second half only):
# JAX_OPS_NORM_FWD_FLAGS (1 next row staged by cp.async, 2 equal-count merge) and
# JAX_OPS_NORM_FWD_STAGE_MIN_THREADS, "FLAGS:MIN_THREADS" pairs in FLAG_SETS.
if has flags; then
  for fs in ${FLAG_SETS:-0:0 1:0 1:1024 2:0 3:1024}; do
    echo "== flags ${fs%%:*} stage_min_threads ${fs##*:}"
    JAX_OPS_NORM_FWD_FLAGS=${fs%%:*} JAX_OPS_NORM_FWD_STAGE_MIN_THREADS=${fs##*:} timeout 120 python3 benchmarks/norm_params_probe.py
  done > "$OUT/flags.txt" 2>&1
  grep -E "^== |^cols" "$OUT/flags.txt" | tee -a "$LOG"
  stage_done flags
fi
if has flagtests; then
  export JAX_OPS_NORM_FWD_FLAGS=${TEST_FLAGS:-3} JAX_OPS_NORM_FWD_STAGE_MIN_THREADS=${TEST_MIN_THREADS:-0}
  timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_layer_norm.py tests/test_add_norm.py \
    -k "${TEST_K:-4096 or 5000 or 8192 or 16384 or 24577 or 32768}" > "$OUT/flagtests.txt" 2>&1
  tail -2 "$OUT/flagtests.txt" | tee -a "$LOG"
  for tool in memcheck synccheck; do
    ROWS=300 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_norm.py \
      4104,8192,16384,32768 > "$OUT/flagsan_$tool.txt" 2>&1; echo "$tool rc $?" | tee -a "$LOG"
  done
  unset JAX_OPS_NORM_FWD_FLAGS JAX_OPS_NORM_FWD_STAGE_MIN_THREADS
  stage_done flagtests
fi
has workspace && workspace_stage
