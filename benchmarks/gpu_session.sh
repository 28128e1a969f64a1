#!/usr/bin/env bash
# One call on the GPU machine: environment, extension check (build there if the carried
# one does not load), tests, compute-sanitizer, benchmarks. Everything lands in $OUT.
# Usage: bash benchmarks/gpu_session.sh [env] [tests] [sanitize] [bench-ln] [bench-rms]
set -uo pipefail
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/jax_ops_out}; mkdir -p "$OUT"
steps=${*:-env check tests bench-ln bench-rms sanitize}
commit=$(cat .carry/COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
export JAX_OPS_COMMIT=$commit  # recorded by the benchmark's JSON

{ date -u +%FT%TZ; echo "commit $commit"; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv; } | tee "$OUT/env.txt"
[ -f .carry/_ffi.so ] && cp .carry/_ffi.so jax_ops/_ffi.cpython-312-x86_64-linux-gnu.so
if ! python3 -c "import jax_ops, sys; sys.exit(0 if jax_ops.with_cuda() else 1)"; then
  echo "carried extension unusable: building here"
  cmake -S . -B build/gpu -G Ninja -DPython_EXECUTABLE="$(command -v python3)" -DJAX_OPS_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null &&
    cmake --build build/gpu -j 16 | tail -3 && cp build/gpu/_ffi*.so jax_ops/
fi
python3 -c "import jax, jax_ops; print('jax', jax.__version__, jax.devices(), 'with_cuda', jax_ops.with_cuda())" | tee -a "$OUT/env.txt"

for step in $steps; do
  case $step in
    tests) python3 -m pytest tests -q -n 4 -p no:cacheprovider 2>&1 | tee "$OUT/tests.txt" | tail -15 ;;
    check) python3 benchmarks/sanitize_norm.py 2>&1 | tail -20 | tee "$OUT/check.txt" ;;
    # Under the sanitizers XLA's compiles crawl: a few shapes, one per kernel tier.
    sanitize) timeout 200 compute-sanitizer --tool memcheck --print-limit 20 python3 benchmarks/sanitize_norm.py 3,33,1025,5000,40000 2>&1 | tail -8 | tee "$OUT/sanitize.txt" ;;
    racecheck) timeout 150 compute-sanitizer --tool racecheck --print-limit 20 python3 benchmarks/sanitize_norm.py 5000,40000 2>&1 | tail -8 | tee "$OUT/racecheck.txt" ;;
    bench-ln) python3 -m jax_ops.bench --op layer_norm --mode fwd,fwd_bwd,bwd --check --json "$OUT/layer_norm.json" 2>&1 | tee "$OUT/layer_norm.txt" ;;
    bench-rms) python3 -m jax_ops.bench --op rms_norm --mode fwd,fwd_bwd,bwd --check --json "$OUT/rms_norm.json" 2>&1 | tee "$OUT/rms_norm.txt" ;;
    env) ;;
    *) echo "unknown step $step" ;;
  esac
done
