#!/usr/bin/env bash
# One device call (issues 19, 20): host cost per call of our ops (benchmarks/host_overhead.py)
# with the carried extension (.carry/_ffi.so.gz, before) and .carry/_ffi_new.so.gz (after);
# with the new one, the CUDA tests of BatchNorm (launchers changed), and ResNet-50's
# training step (model_step.py, XLA's default flags). Every stage has a time limit; a
# stage that runs out dumps its Python stack (faulthandler on SIGABRT).
set -uo pipefail
source benchmarks/gpu_extension.sh
SO=jax_ops/_ffi.cpython-312-x86_64-linux-gnu.so
HOST_ARGS=${HOST_ARGS:---calls 16 --execs 5 --repeats 3}
t0=$SECONDS
timeout -s ABRT ${HOST_TIMEOUT:-60} python3 -X faulthandler benchmarks/host_overhead.py $HOST_ARGS --out "$OUT/host_before.json" > "$OUT/host_before.txt" 2>&1
grep "per call" "$OUT/host_before.txt"; grep -A30 "most recent call first" "$OUT/host_before.txt" | head -40
echo "host before: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
gunzip -c .carry/_ffi_new.so.gz > $SO && echo "new extension" | tee -a "$OUT/env.txt"
timeout -s ABRT ${HOST_TIMEOUT:-60} python3 -X faulthandler benchmarks/host_overhead.py $HOST_ARGS --out "$OUT/host_after.json" > "$OUT/host_after.txt" 2>&1
grep "per call" "$OUT/host_after.txt"
echo "host after: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
timeout ${TEST_TIMEOUT:-100} python3 -m pytest -q -n 12 -p no:cacheprovider -k "cuda" tests/test_batch_norm.py 2>&1 | tail -3 | tee "$OUT/tests.txt"
echo "tests: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
timeout -s ABRT ${MODEL_TIMEOUT:-120} python3 benchmarks/model_step.py --models resnet50 --modes train --profile-rows 0 --out "$OUT/model_step.json" 2>&1 \
  | grep -v "deprecated\|Warning" | grep -E "ms/step|speedup" | tee "$OUT/model_step.txt"
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
