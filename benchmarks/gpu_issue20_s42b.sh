#!/bin/bash
# Issue 20, forty-second session, run 2: the bulk-copy alignment probe
# (benchmarks/bulk_align_probe.cu), then build Z (the shifted kernel's copies from 128-byte
# lines): its shifted-row tests, and LayerNorm / add_rms_norm bf16 bwd with the shifted
# kernel on and off.
set -uo pipefail
STAGES=${1:-probe,tests,shiftab}
source benchmarks/gpu_extension.sh
source benchmarks/gpu_stages.sh
if starts probe; then
  nvcc -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -I. benchmarks/bulk_align_probe.cu -o /tmp/probe 2>&1 | grep -i error
  timeout 60 /tmp/probe | tee "$OUT/probe.txt" | tee -a "$LOG"
  stage_done probe
fi
starts tests && TEST_TIMEOUT=100 norm_tests tests/test_layer_norm.py tests/test_add_norm.py -k "unaligned_rows"
if starts shiftab; then
  for op in ${SHIFT_OPS:-layer_norm add_rms_norm}; do
    cfg_sweep shiftab_$op "default BWD_SHIFT=0" bf16 --op $op --mode bwd --cols ${SHIFT_COLS:-2048,2052,3075,4100,6148}
  done
fi
finish_call "log|env|tests|probe"
exit 0
