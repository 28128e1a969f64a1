#!/usr/bin/env bash
# One device call (issue 19, sixth session): ResNet-50's train and inference steps
# (model_step.py) with every rewrite (auto), without pointwise_conv, and with every
# rewrite under XLA's command buffers extended to convolutions.
set -uo pipefail
source benchmarks/gpu_extension.sh
t0=$SECONDS
ms() {  # label, model_step args...
  local label=$1; shift
  timeout -s ABRT ${MODEL_LIMIT:-200} python3 benchmarks/model_step.py --models resnet50 --modes train infer \
    --profile-rows 40 --out "$OUT/$label.json" "$@" 2>&1 | grep -v "deprecated\|Warning" | grep -E "ms/step|speedup" | tee "$OUT/$label.txt"
  echo "$label: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
}
ms auto
ms no_pointwise --no-original --exclude pointwise_conv
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CONVOLUTION" ms auto_conv_graphs
