#!/usr/bin/env bash
# One device call: build the extension (sm_90) unless carried, run the GPU tests of the
# cross-entropy op and the fx profile, then the cross-entropy benchmarks.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
OUT=${OUT:-/tmp/jax_ops_out}; mkdir -p "$OUT"
TEST_TIMEOUT=200 bash benchmarks/gpu_tests.sh tests/test_cross_entropy.py "tests/test_fx.py::test_gpu_profile_on_the_gpu" "tests/test_fx.py::test_gpu_profile_attributes_custom_call_kernels" tests/test_fx_attention.py
t0=$SECONDS
timeout 150 python3 -m jax_ops.bench --op cross_entropy --rows 16384 --cols 50304 --dtype bf16 --impl cuda,pallas,xla --mode fwd,fwd_bwd --json "$OUT/ce_bench.json" 2>&1 | grep -v Warn | tail -12
timeout 150 python3 benchmarks/ce_step.py --out "$OUT/ce_step.json" 2>&1 | grep -v Warn | tail -12
echo "ce benchmarks: $((SECONDS - t0)) s"
