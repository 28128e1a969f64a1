#!/usr/bin/env bash
# One device call: build the extension for sm_90 here if none is carried (.carry/_ffi.so.gz),
# run pytest on the GPU (CUDA kernels and Pallas native), return the extension and logs.
# Usage: bash benchmarks/gpu_tests.sh [pytest args...]   (default: the whole suite)
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/jax_ops_out}; mkdir -p "$OUT"
{ date -u +%FT%TZ; echo "commit $(cat .carry/COMMIT 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } | tee "$OUT/env.txt"
if [ -f .carry/_ffi.so.gz ]; then
  gunzip -c .carry/_ffi.so.gz > jax_ops/_ffi.cpython-312-x86_64-linux-gnu.so
else
  t0=$SECONDS
  cmake -S . -B build/gpu -G Ninja -DPython_EXECUTABLE="$(command -v python3)" -DJAX_OPS_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/build.txt" 2>&1 &&
    cmake --build build/gpu -j 16 >> "$OUT/build.txt" 2>&1 && cp build/gpu/_ffi*.so jax_ops/ &&
    gzip -c jax_ops/_ffi*.so > "$OUT/ffi.so.gz"
  echo "build: $((SECONDS - t0)) s, rc $?" | tee -a "$OUT/env.txt"; tail -3 "$OUT/build.txt"
fi
python3 -c "import jax, jax_ops; print('jax', jax.__version__, jax.devices(), 'with_cuda', jax_ops.with_cuda())" | tee -a "$OUT/env.txt"
t0=$SECONDS
timeout ${TEST_TIMEOUT:-480} python3 -m pytest -q -n ${TEST_WORKERS:-12} -p no:cacheprovider --durations=10 "${@:-tests}" 2>&1 | tee "$OUT/tests.txt" | tail -25
echo "tests: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
