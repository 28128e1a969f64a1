#!/usr/bin/env bash
# One device call (sixth session, issue 19, final code): the GPU tests of the conv
# rewrites; ResNet-50's train and inference steps (model_step.py, XLA's default flags,
# 10x10 steps, profiles before/after).
set -uo pipefail
source benchmarks/gpu_extension.sh
t0=$SECONDS
timeout 100 python3 -m pytest -q -n 12 -p no:cacheprovider tests/test_fx_conv_space_to_depth.py \
  tests/test_fx_pointwise_conv.py 2>&1 | tail -3 | tee "$OUT/tests.txt"
echo "tests: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
timeout -s ABRT 240 python3 benchmarks/model_step.py --models resnet50 --modes train infer --repeats 10 \
  --profile-rows 40 --out "$OUT/resnet.json" 2>&1 | grep -v "deprecated\|Warning" | grep -E "ms/step|speedup" | tee "$OUT/resnet.txt"
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
