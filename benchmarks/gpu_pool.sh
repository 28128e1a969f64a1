#!/usr/bin/env bash
# One device call (issue 19): the max_pool rewrite at ResNet-50's stem pool
# (benchmarks/max_pool_gpu.py), its tests on the GPU, and ResNet-50's training step
# (model_step.py, XLA's default flags) with the profile's top rows (bytes, GB/s).
set -uo pipefail
source benchmarks/gpu_extension.sh
t0=$SECONDS
timeout -s ABRT 60 python3 -X faulthandler benchmarks/max_pool_gpu.py 2>&1 | grep -v Warn | tee "$OUT/max_pool.txt"
echo "pool: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
timeout 60 python3 -m pytest -q -n 12 -p no:cacheprovider tests/test_fx_max_pool.py 2>&1 | tail -2 | tee "$OUT/tests_max_pool.txt"
echo "tests: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
timeout -s ABRT 150 python3 benchmarks/model_step.py --models resnet50 --modes ${MODES:-train} --profile-rows 25 --out "$OUT/model_step.json" 2>&1 \
  | grep -v "deprecated\|Warning" | grep -E "ms/step|speedup|max_pool" | tee "$OUT/model_step.txt"
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
