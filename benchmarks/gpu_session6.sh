#!/usr/bin/env bash
# One device call (sixth session, issues 19 and 20): the GPU tests of the new conv
# rewrites and of the norms; compute-sanitizer on the block-per-row forward; the
# LayerNorm/RMSNorm/add+norm forward at 8192-32768 columns with the rows read with the
# streaming hint and without (JAX_OPS_NORM_FWD_STREAMING); ResNet-50's train and
# inference steps (model_step.py, XLA's default flags).
set -uo pipefail
source benchmarks/gpu_extension.sh
t0=$SECONDS
B="python3 -m jax_ops.bench --repeats 3"
timeout 150 python3 -m pytest -q -n 12 -p no:cacheprovider tests/test_fx_conv_space_to_depth.py \
  tests/test_fx_pointwise_conv.py tests/test_layer_norm.py tests/test_add_norm.py 2>&1 | tail -3 | tee "$OUT/tests.txt"
echo "tests: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_norm.py \
  8192,8200,16384,24577,32768 > "$OUT/sanitize_memcheck.txt" 2>&1; echo "memcheck rc $?" | tee -a "$OUT/env.txt"
tail -2 "$OUT/sanitize_memcheck.txt"
for s in 1 0; do
  JAX_OPS_NORM_FWD_STREAMING=$s timeout 100 $B --op layer_norm,rms_norm,add_layer_norm --dtype bf16 --impl cuda \
    --mode fwd --cols 8192,16384,32768 --json "$OUT/fwd_streaming$s.json" > "$OUT/fwd_streaming$s.txt" 2>&1
  grep -E "^[a-z_]+ fwd " "$OUT/fwd_streaming$s.txt" | sed "s/^/streaming=$s /"
  echo "sweep $s: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
done
timeout -s ABRT 200 python3 benchmarks/model_step.py --models resnet50 --modes train infer \
  --profile-rows 40 --out "$OUT/resnet.json" 2>&1 | grep -v "deprecated\|Warning" | grep -E "ms/step|speedup" | tee "$OUT/resnet.txt"
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
