#!/usr/bin/env bash
# One device call (issue 19): ResNet-50's step timeline (benchmarks/step_timeline.py) with
# XLA's default command-buffer types and with convolutions added, both recorded while
# profiling; then model_step.py with the full profiles (PROFILE_ROWS, default 400).
# Usage: bash benchmarks/gpu_timeline.sh
set -uo pipefail
source benchmarks/gpu_extension.sh
python3 -c "import jax, jax_ops, transformers; print('jax', jax.__version__, jax.devices(), 'with_cuda', jax_ops.with_cuda(), 'transformers', transformers.__version__)" 2>&1 | grep -v Warn | tee -a "$OUT/env.txt"
P="--xla_enable_command_buffers_during_profiling=true"
t0=$SECONDS
XLA_FLAGS="$P" python3 benchmarks/step_timeline.py --out "$OUT/timeline_default.json" 2>&1 | grep -v "deprecated\|Warning" | tee "$OUT/timeline_default.txt"
echo "timeline default: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
XLA_FLAGS="$P --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CONVOLUTION" python3 benchmarks/step_timeline.py \
  --out "$OUT/timeline_conv.json" 2>&1 | grep -v "deprecated\|Warning" | tee "$OUT/timeline_conv.txt"
echo "timeline conv: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
python3 benchmarks/model_step.py --models resnet50 --repeats 3 --profile-rows ${PROFILE_ROWS:-400} --out "$OUT/model_step.json" 2>&1 \
  | grep -v "deprecated\|Warning" | grep -E "ms/step|speedup" | tee "$OUT/model_step.txt"
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
