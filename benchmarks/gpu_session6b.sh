#!/usr/bin/env bash
# One device call (sixth session, issue 19): the GPU tests of the conv rewrites and of
# the models; ResNet-50's train and inference steps (model_step.py, XLA's default flags,
# 10x10 steps), inference again without pointwise_conv (the fold keeps every conv).
set -uo pipefail
source benchmarks/gpu_extension.sh
t0=$SECONDS
timeout 150 python3 -m pytest -q -n 12 -p no:cacheprovider tests/test_fx_conv_space_to_depth.py \
  tests/test_fx_pointwise_conv.py tests/test_fx_max_pool.py tests/test_fx_models.py 2>&1 | tail -4 | tee "$OUT/tests.txt"
echo "tests: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
timeout -s ABRT 240 python3 benchmarks/model_step.py --models resnet50 --modes train infer --repeats 10 \
  --profile-rows 40 --out "$OUT/resnet.json" 2>&1 | grep -v "deprecated\|Warning" | grep -E "ms/step|speedup" | tee "$OUT/resnet.txt"
echo "resnet: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
timeout -s ABRT 120 python3 benchmarks/model_step.py --models resnet50 --modes infer --repeats 10 --no-original \
  --exclude pointwise_conv --profile-rows 40 --out "$OUT/resnet_infer_no_pointwise.json" 2>&1 \
  | grep -v "deprecated\|Warning" | grep -E "ms/step|speedup" | tee "$OUT/resnet_infer_no_pointwise.txt"
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
