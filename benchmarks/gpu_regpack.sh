#!/usr/bin/env bash
# One device call (eighth session, issue 20): the norm kernels with rows held as 32-bit
# words (RegPack) and the bounded K 8 forward, against the previous build carried in
# .carry/base (same machine, same run); norm tests; where the add+norm training step's
# time goes. Usage: bash benchmarks/gpu_regpack.sh [stages] (tests,ab,knobs,breakdown,step)
# The RegPack build and its knob JAX_OPS_NORM_FWD_K8_BOUNDED were not kept: they are
# results/2026-11-26_H100_addnorm/run2_regpack.diff applied to 5f5f78f.
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests,ab,knobs,breakdown}
source benchmarks/gpu_stages.sh
SO=jax_ops/_ffi.cpython-312-x86_64-linux-gnu.so
B="python3 -m jax_ops.bench --repeats 3 --dtype bf16"
has tests && norm_tests
sweep() {  # $1: label
  { echo "== $1"
    timeout 120 $B --impl cuda --op layer_norm,rms_norm --mode fwd --cols 32,128,512,1024,2048,4096,8192,16384,32768
    timeout 90 $B --impl cuda --op layer_norm,rms_norm --mode bwd --cols 32,128,512,768,1024,2048
    timeout 90 $B --impl cuda --op add_layer_norm,add_rms_norm --mode fwd,bwd --cols 768,2048,4096,16384
  } >> "$OUT/ab.txt" 2>&1
}
if has ab; then
  sweep new
  cp $SO /tmp/new.so && gunzip -c .carry/base/_ffi.so.gz > $SO && sweep "base $(cat .carry/base/COMMIT)"
  cp /tmp/new.so $SO
  grep -E "^== |^[a-z_]+ (fwd|bwd|fwd_bwd|step) " "$OUT/ab.txt" | tee -a "$LOG"
  stage_done ab
fi
if has knobs; then
  { echo "== K8 unbounded"; JAX_OPS_NORM_FWD_K8_BOUNDED=0 timeout 60 $B --impl cuda --op layer_norm,rms_norm,add_layer_norm --mode fwd --cols 16384
    echo "== add+norm in the warp tier to 8 KiB rows"; JAX_OPS_NORM_FWD_ADD_REGS_MAX_BYTES=8192 timeout 60 $B --impl cuda \
      --op add_layer_norm,add_rms_norm --mode fwd --cols 4096; } > "$OUT/knobs.txt" 2>&1
  grep -E "^== |^[a-z_]+ (fwd|bwd|fwd_bwd|step) " "$OUT/knobs.txt" | tee -a "$LOG"
  stage_done knobs
fi
if has breakdown; then
  MODES=step,fwd_res,bwd timeout 150 python3 benchmarks/kernel_breakdown.py add_layer_norm bf16 49152 4096 auto flax \
    > "$OUT/breakdown.txt" 2>&1
  MODES=step timeout 60 python3 benchmarks/kernel_breakdown.py layer_norm bf16 49152 4096 auto >> "$OUT/breakdown.txt" 2>&1
  cat "$OUT/breakdown.txt" | cut -c1-150 | tee -a "$LOG"
  stage_done breakdown
fi
if has step; then
  timeout 200 $B --impl cuda,auto,flax --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode step \
    --cols ${STEP_COLS:-32,128,512,1024,4096,8192,16384,32768} --json "$OUT/step.json" > "$OUT/step.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd|step) " "$OUT/step.txt" | tee -a "$LOG"
  stage_done step
fi
