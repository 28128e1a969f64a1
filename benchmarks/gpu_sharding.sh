#!/usr/bin/env bash
# One device call on a multi-GPU machine (issues 21/23): the sharding benchmark of every op
# family (benchmarks/sharding_gpu.py), the multi-device tests that run on 2 devices, and
# the batch-sharded BatchNorm stage tests on the GPU (also under compute-sanitizer).
# Usage: bash benchmarks/gpu_sharding.sh [sharding_gpu.py args] (extension: .carry/_ffi.so.gz).
source benchmarks/gpu_extension.sh
nvidia-smi topo -m >> "$OUT/env.txt" 2>&1
python3 -c 'import jax; print(jax.__version__, jax.devices())' | tee -a "$OUT/env.txt"
# XLA's GPU flags about collective kernels (what the small all-reduces run as)
for so in $(python3 -c 'import jax_plugins, glob; print(" ".join(f for p in jax_plugins.__path__ for f in glob.glob(p + "/**/*.so", recursive=True)))' 2>/dev/null); do
  strings "$so" | grep -E '^xla_gpu[a-z_]*(one_shot|collective_kernel|all_reduce|nvshmem)[a-z_]*$' ; done | sort -u > "$OUT/xla_collective_flags.txt" || true
set -o pipefail
timeout 400 python3 benchmarks/sharding_gpu.py --out "$OUT/sharding.json" "$@" 2>&1 | tee "$OUT/sharding.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  { timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_sharding.py tests/test_sharding_hidden.py \
      tests/test_batch_norm.py tests/test_cross_entropy.py -k "device or shard or mesh or stage" 2>&1 | tail -4
    timeout 110 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_cross_entropy.py 2>&1 | tail -2
    echo "# compute-sanitizer memcheck, the BatchNorm and cross-entropy stage kernels (float32, bfloat16)"
    timeout 140 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
      tests/test_batch_norm.py tests/test_cross_entropy.py \
      -k "(stages_against or vocab_stages) and cuda and (float32 or bfloat16)" 2>&1 | grep -E "passed|failed|ERROR SUMMARY|error" | tail -4
  } | tee "$OUT/tests.txt"
fi
