#!/usr/bin/env bash
# One device call (issues 19, 20): the conv-fusion probe; the norm backward of the carried
# extension (.carry/_ffi.so.gz, before) against .carry/_ffi_new.so.gz (after); with the
# new one, the norm tests and the fwd / bwd / fwd_bwd / step sweep (auto and flax;
# TABLE=jax_ops/tables/<gpu>.json merges its cuda times into that table, copied to $OUT).
# Usage: bash benchmarks/gpu_step.sh [stages]   stages: probe,before,tests,after,sweep
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-probe,before,tests,after,sweep}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
B="python3 -m jax_ops.bench --repeats 3"
SO=jax_ops/_ffi.cpython-312-x86_64-linux-gnu.so
if has probe; then timeout 150 python3 benchmarks/conv_fusion_probe.py > "$OUT/conv_probe.txt" 2>&1; tail -40 "$OUT/conv_probe.txt"; fi
bwd_sweep() {  # the cuda backward at 4096-32768 columns, and 65536 at 12288 rows
  timeout 100 $B --op layer_norm,rms_norm,add_layer_norm --dtype bf16 --impl cuda --mode bwd \
    --cols 4096,8192,16384,32768 > "$OUT/bwd_$1.txt" 2>&1
  timeout 40 $B --op layer_norm,rms_norm --dtype bf16 --impl cuda --mode bwd --rows 12288 --cols 65536 \
    >> "$OUT/bwd_$1.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd|step) " "$OUT/bwd_$1.txt"
}
has before && bwd_sweep before
[ -f .carry/_ffi_new.so.gz ] && gunzip -c .carry/_ffi_new.so.gz > $SO && echo "new extension" | tee -a "$OUT/env.txt"
python3 -c "import jax, jax_ops; print('jax', jax.__version__, jax.devices(), 'with_cuda', jax_ops.with_cuda())" | tee -a "$OUT/env.txt"
if has tests; then
  t0=$SECONDS
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -n 12 -p no:cacheprovider tests/test_layer_norm.py tests/test_add_norm.py \
    2>&1 | tail -5 | tee "$OUT/tests_norms.txt"
  timeout 80 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_norm.py \
      2048,8200,16384,24577,70000 > "$OUT/memcheck.txt" 2>&1; echo "memcheck rc $?" | tee -a "$OUT/env.txt"
  echo "tests: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
fi
has after && bwd_sweep after
if has sweep; then
  timeout 260 $B --op layer_norm,rms_norm --dtype bf16 --impl cuda,auto,flax --mode fwd,bwd,fwd_bwd,step \
    --cols ${SWEEP_COLS:-1024,4096,8192,16384,32768} ${TABLE:+--table $TABLE} --json "$OUT/sweep_step.json" > "$OUT/sweep_step.txt" 2>&1
  timeout 80 $B --op layer_norm,rms_norm --dtype bf16 --impl cuda,auto,flax --mode bwd,fwd_bwd,step --rows 12288 \
    --cols 65536 ${TABLE:+--table $TABLE} --json "$OUT/sweep_step_65536.json" > "$OUT/sweep_step_65536.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd|step) " "$OUT/sweep_step.txt" "$OUT/sweep_step_65536.txt" | grep -v "^$"
  [ -n "${TABLE:-}" ] && cp "$TABLE" "$OUT/"
fi
