#!/usr/bin/env bash
# One device call (sixth session; H200): issue 19's ResNet-50 steps with the final code
# (a relu after a conv left to XLA's fused conv), its GPU tests, and issue 20's norm
# sweep at long rows on the H200 (benchmarks/gpu_norms.sh sweep).
set -uo pipefail
source benchmarks/gpu_extension.sh
t0=$SECONDS
timeout 100 python3 -m pytest -q -n 12 -p no:cacheprovider tests/test_fx.py -k "relu or conv" 2>&1 | tail -2 | tee "$OUT/tests.txt"
echo "tests: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
timeout -s ABRT 240 python3 benchmarks/model_step.py --models resnet50 --modes train infer --repeats 10 \
  --profile-rows 40 --out "$OUT/resnet.json" 2>&1 | grep -v "deprecated\|Warning" | grep -E "ms/step|speedup" | tee "$OUT/resnet.txt"
echo "resnet: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
OUT=$OUT/norms bash benchmarks/gpu_norms.sh sweep
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
