#!/usr/bin/env bash
# One device call: build the extension for sm_90 here if none is carried (.carry/_ffi.so.gz),
# run pytest on the GPU (CUDA kernels and Pallas native), return the extension and logs.
# Usage: bash benchmarks/gpu_tests.sh [pytest args...]   (default: the whole suite)
set -uo pipefail
source benchmarks/gpu_extension.sh
python3 -c "import jax, jax_ops; print('jax', jax.__version__, jax.devices(), 'with_cuda', jax_ops.with_cuda())" | tee -a "$OUT/env.txt"
t0=$SECONDS
timeout ${TEST_TIMEOUT:-480} python3 -m pytest -q -n ${TEST_WORKERS:-12} -p no:cacheprovider --durations=10 "${@:-tests}" 2>&1 | tee "$OUT/tests.txt" | tail -25
echo "tests: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
