#!/usr/bin/env bash
# One device call: the carried wheels (transformers 4.57 and its deps, .carry/wheels) and
# the carried extension (.carry/_ffi.so.gz, else a fresh build), then benchmarks/model_step.py.
# Usage: bash benchmarks/gpu_models.sh [model_step.py args...]
set -uo pipefail
source benchmarks/gpu_extension.sh
python3 -c "import jax, jax_ops, transformers; print('jax', jax.__version__, jax.devices(), 'with_cuda', jax_ops.with_cuda(), 'transformers', transformers.__version__)" 2>&1 | grep -v Warn | tee -a "$OUT/env.txt"
t0=$SECONDS
python3 benchmarks/model_step.py --out "$OUT/model_step.json" "$@" 2>&1 | grep -v "deprecated\|Warning" | tee "$OUT/model_step.txt"
echo "models: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
