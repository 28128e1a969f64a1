# Sourced by the device-call scripts: OUT, env.txt, and the extension in place — the
# carried build (.carry/_ffi.so.gz) or a fresh sm_90 build, returned as $OUT/ffi.so.gz.
# Carried wheels (.carry/wheels: transformers 4.57 and its deps for the model benchmarks)
# are installed to /tmp/hf_pkgs, put on PYTHONPATH.
if compgen -G ".carry/wheels/*.whl" > /dev/null; then
  pip install -q --no-deps --no-index --target /tmp/hf_pkgs .carry/wheels/*.whl 2>&1 | grep -v WARNING | tail -2
  export PYTHONPATH=/tmp/hf_pkgs${PYTHONPATH:+:$PYTHONPATH}
fi
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
