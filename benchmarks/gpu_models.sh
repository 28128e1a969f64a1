#!/usr/bin/env bash
# One device call: install the carried wheels (transformers 4.57 and its deps, .carry/wheels),
# use the carried extension (.carry/_ffi.so.gz) or build it, run benchmarks/model_step.py.
# Usage: bash benchmarks/gpu_models.sh [model_step.py args...]
set -uo pipefail
pip install -q --no-deps --no-index --target /tmp/hf_pkgs .carry/wheels/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/hf_pkgs${PYTHONPATH:+:$PYTHONPATH}
source benchmarks/gpu_extension.sh
python3 -c "import jax, jax_ops, transformers; print('jax', jax.__version__, jax.devices(), 'with_cuda', jax_ops.with_cuda(), 'transformers', transformers.__version__)" 2>&1 | grep -v Warn | tee -a "$OUT/env.txt"
t0=$SECONDS
python3 benchmarks/model_step.py --out "$OUT/model_step.json" "$@" 2>&1 | grep -v "deprecated\|Warning" | tee "$OUT/model_step.txt"
echo "models: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
