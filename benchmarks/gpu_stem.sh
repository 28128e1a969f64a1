#!/usr/bin/env bash
# One device call (issue 19, sixth session): ResNet-50's stem conv regrouped
# (benchmarks/stem_conv_gpu.py), the max_pool rewrite's phase-split views
# (benchmarks/max_pool_gpu.py), and ResNet-50's train and inference steps (model_step.py,
# XLA's default flags) with the profiles' top rows.
set -uo pipefail
source benchmarks/gpu_extension.sh
t0=$SECONDS
timeout -s ABRT 180 python3 -X faulthandler benchmarks/stem_conv_gpu.py 2>&1 | grep -v Warn | tee "$OUT/stem_conv.txt"
echo "stem: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
timeout -s ABRT 60 python3 -X faulthandler benchmarks/max_pool_gpu.py 2>&1 | grep -v Warn | tee "$OUT/max_pool.txt"
echo "pool: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
if [ -n "${TESTS:-}" ]; then
  timeout 120 python3 -m pytest -q -n 12 -p no:cacheprovider $TESTS 2>&1 | tail -3 | tee "$OUT/tests.txt"
  echo "tests: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
fi
timeout -s ABRT ${MODEL_LIMIT:-300} python3 benchmarks/model_step.py --models resnet50 --modes ${MODES:-train infer} \
  --profile-rows 25 --out "$OUT/model_step.json" 2>&1 \
  | grep -v "deprecated\|Warning" | tee "$OUT/model_step.txt"
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
