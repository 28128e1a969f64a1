#!/usr/bin/env bash
# One device call: install the carried wheels (transformers 4.57 and its deps, .carry/wheels),
# use the carried extension (.carry/_ffi.so.gz) or build it, run benchmarks/model_step.py.
# Usage: bash benchmarks/gpu_models.sh [model_step.py args...]
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
OUT=${OUT:-/tmp/jax_ops_out}; mkdir -p "$OUT"
{ date -u +%FT%TZ; echo "commit $(cat .carry/COMMIT 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } | tee "$OUT/env.txt"
# into their own directory, first on the path: the machine's torch environment has transformers 5
pip install -q --no-deps --no-index --target /tmp/hf_pkgs .carry/wheels/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/hf_pkgs:$PYTHONPATH
if [ -f .carry/_ffi.so.gz ]; then
  gunzip -c .carry/_ffi.so.gz > jax_ops/_ffi.cpython-312-x86_64-linux-gnu.so
else
  t0=$SECONDS
  cmake -S . -B build/gpu -G Ninja -DPython_EXECUTABLE="$(command -v python3)" -DJAX_OPS_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/build.txt" 2>&1 &&
    cmake --build build/gpu -j 16 >> "$OUT/build.txt" 2>&1 && cp build/gpu/_ffi*.so jax_ops/ &&
    gzip -c jax_ops/_ffi*.so > "$OUT/ffi.so.gz"
  echo "build: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"; tail -3 "$OUT/build.txt"
fi
python3 -c "import jax, jax_ops, transformers; print('jax', jax.__version__, jax.devices(), 'with_cuda', jax_ops.with_cuda(), 'transformers', transformers.__version__)" 2>&1 | grep -v Warn | tee -a "$OUT/env.txt"
t0=$SECONDS
python3 benchmarks/model_step.py --out "$OUT/model_step.json" "$@" 2>&1 | grep -v "deprecated\|Warning" | tee "$OUT/model_step.txt"
echo "models: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
