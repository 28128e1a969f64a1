#!/usr/bin/env bash
# One device call (seventh session, issue 20): the block-per-row norm backward with its
# rows staged in shared memory by bulk copies (sm_90 TMA) and the cluster tier's relaxed
# barrier arrivals: tests with many rows, compute-sanitizer with stage refills, and the
# A/B against the register kernel (knob), same machine.
# Usage: bash benchmarks/gpu_bulk.sh [stages]  (tests,sanitize,ab,variants; default all)
# (RACECHECK_TIMEOUT, RACECHECK_COLS: racecheck's limit and columns)
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests,sanitize,ab,variants}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
B="python3 -m jax_ops.bench --repeats 3"
LOG="$OUT/log.txt"
t0=$SECONDS
if has tests; then
  timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_layer_norm.py tests/test_add_norm.py \
    -k "many_long_rows or 1025 or 4096 or 5000 or 8200 or 16384 or 20001 or 24577 or 32768 or 40960 or 65536" \
    > "$OUT/tests.txt" 2>&1; tail -3 "$OUT/tests.txt" | tee -a "$LOG"
  echo "tests: $((SECONDS - t0)) s" | tee -a "$LOG"
fi
if has sanitize; then
  { ROWS=500 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_norm.py \
      2048,4096,8200,16384,32768 2>&1; echo "memcheck rc $?"
    ROWS=600 timeout ${RACECHECK_TIMEOUT:-90} compute-sanitizer --tool racecheck --error-exitcode 9 \
      python3 benchmarks/sanitize_norm.py ${RACECHECK_COLS:-4096,16384} 2>&1; echo "racecheck rc $?"
    ROWS=200 timeout 90 compute-sanitizer --tool synccheck --error-exitcode 9 python3 benchmarks/sanitize_norm.py \
      4096,16384 2>&1; echo "synccheck rc $?"; } > "$OUT/sanitize.txt"
  grep -E "rc [0-9]|ERROR SUMMARY|worst" "$OUT/sanitize.txt" | tee -a "$LOG"
  echo "sanitize: $((SECONDS - t0)) s" | tee -a "$LOG"
fi
V="$B --dtype bf16 --impl cuda --op layer_norm,rms_norm --mode bwd --cols ${AB_COLS:-2048,4096,8192,16384,32768}"
if has ab; then  # bulk backward on (default) and off, same machine
  timeout 150 $V --json "$OUT/bulk_on.json" > "$OUT/ab.txt" 2>&1
  JAX_OPS_NORM_BWD_BULK_STAGES=0 timeout 150 $V --json "$OUT/bulk_off.json" >> "$OUT/ab.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd) " "$OUT/ab.txt" | tee -a "$LOG"
  echo "ab: $((SECONDS - t0)) s" | tee -a "$LOG"
fi
if has variants; then  # stage counts; add+norm and f32 on and off; the step against flax
  for st in 2 4; do
    echo "== stages $st" >> "$OUT/variants.txt"
    JAX_OPS_NORM_BWD_BULK_STAGES=$st timeout 100 $B --dtype bf16 --impl cuda --op layer_norm --mode bwd \
      --cols 2048,4096,8192 >> "$OUT/variants.txt" 2>&1
  done
  for knob in 3 0; do
    echo "== add+norm, f32, JAX_OPS_NORM_BWD_BULK_STAGES=$knob" >> "$OUT/variants.txt"
    JAX_OPS_NORM_BWD_BULK_STAGES=$knob timeout 80 $B --dtype bf16 --impl cuda --op add_layer_norm,add_rms_norm \
      --mode fwd_bwd --cols 4096,8192 >> "$OUT/variants.txt" 2>&1
    JAX_OPS_NORM_BWD_BULK_STAGES=$knob timeout 80 $B --dtype f32 --impl cuda --op layer_norm --mode bwd \
      --cols 4096,8192 >> "$OUT/variants.txt" 2>&1
  done
  echo "== step, auto against flax" >> "$OUT/variants.txt"
  timeout 150 $B --dtype bf16 --impl cuda,auto,flax --op layer_norm,rms_norm --mode step \
    --cols 2048,4096,8192,16384,32768 --json "$OUT/step.json" >> "$OUT/variants.txt" 2>&1
  grep -E "^== |^[a-z_]+ (fwd|bwd|fwd_bwd|step) " "$OUT/variants.txt" | tee -a "$LOG"
  echo "variants: $((SECONDS - t0)) s" | tee -a "$LOG"
fi
