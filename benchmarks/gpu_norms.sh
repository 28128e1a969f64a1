#!/usr/bin/env bash
# One device call (issue 20): the norm tests (cluster tier included), compute-sanitizer on
# long rows, the long-row sweep with the sm_90 cluster tier and without it (knobs), the
# workspace / temporary-memory report. Usage: bash benchmarks/gpu_norms.sh [stages]
# stages: a comma list of tests,sanitize,sweep,variants,addnorm,workspace (default all).
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests,sanitize,sweep,variants,addnorm,workspace}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
python3 -c "import jax, jax_ops; print('jax', jax.__version__, jax.devices(), 'with_cuda', jax_ops.with_cuda())" | tee -a "$OUT/env.txt"
B="python3 -m jax_ops.bench --repeats 3"
if has tests; then
  t0=$SECONDS
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -n ${TEST_WORKERS:-12} -p no:cacheprovider --durations=5 \
    tests/test_layer_norm.py tests/test_add_norm.py ${EXTRA_TESTS:-} 2>&1 | tee "$OUT/tests_norms.txt" | tail -8
  echo "tests: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
fi
if has sanitize; then
  for tool in ${SANITIZERS:-memcheck}; do
    timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_norm.py \
      8200,16384,24577,65536,70000 > "$OUT/sanitize_$tool.txt" 2>&1; echo "$tool rc $?" | tee -a "$OUT/env.txt"
    tail -3 "$OUT/sanitize_$tool.txt"
  done
fi
if has sweep; then  # the default build: clusters from 8193 columns (bf16); 65536 at fewer rows (memory)
  timeout 200 $B --op layer_norm,rms_norm --dtype bf16 --impl cuda,xla,auto,flax --mode fwd,bwd,fwd_bwd \
    --cols 8192,16384,32768 --json "$OUT/sweep_long.json" > "$OUT/sweep_long.txt" 2>&1
  timeout 60 $B --op layer_norm,rms_norm --dtype bf16 --impl cuda,flax --mode fwd,bwd,fwd_bwd --rows 12288 \
    --cols 65536 --json "$OUT/sweep_65536.json" > "$OUT/sweep_65536.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd) " "$OUT/sweep_long.txt" "$OUT/sweep_65536.txt"
fi
if has variants; then  # knobs: the cluster tier off; other block shapes (bf16)
  V="$B --dtype bf16 --impl cuda"
  JAX_OPS_NORM_FWD_CLUSTER_MIN_BYTES=0 JAX_OPS_NORM_BWD_CLUSTER_MIN_COLS=0 timeout 80 $V --op layer_norm,rms_norm \
    --mode fwd,bwd --cols 16384,32768 > "$OUT/variant_no_clusters.txt" 2>&1
  JAX_OPS_NORM_FWD_CLUSTER_MIN_BYTES=8192 JAX_OPS_NORM_BWD_CLUSTER_MIN_COLS=4096 timeout 60 $V --op layer_norm \
    --mode fwd,bwd --cols 4096,8192 > "$OUT/variant_clusters_from_4096.txt" 2>&1
  for tp in 128,4 256,8 512,2 512,4; do
    JAX_OPS_NORM_FWD_CLUSTER_THREADS=${tp%,*} JAX_OPS_NORM_FWD_CLUSTER_PACKS=${tp#*,} timeout 50 $V --op layer_norm \
      --mode fwd --cols 16384,32768 > "$OUT/variant_fwd_${tp/,/x}.txt" 2>&1
  done
  JAX_OPS_NORM_BWD_CLUSTER_THREADS=256 timeout 50 $V --op layer_norm --mode bwd --cols 16384,32768 \
    > "$OUT/variant_bwd_256.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd) " "$OUT"/variant_*.txt
fi
if has addnorm; then
  timeout 120 $B --op add_layer_norm,add_rms_norm --dtype bf16 --impl cuda,auto,flax --mode fwd,fwd_bwd \
    --cols 1024,4096,16384 --json "$OUT/sweep_add_norm.json" > "$OUT/sweep_add_norm.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd) " "$OUT/sweep_add_norm.txt"
fi
if has workspace; then
  timeout 120 python3 benchmarks/norm_workspace.py --json "$OUT/workspace.json" 2>&1 | tee "$OUT/workspace.txt"
fi
